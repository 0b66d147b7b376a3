"""Generations you can read: a few of each step's responses, decoded, in `samples.jsonl`.

`logging.samples: N` rows per training step (one per prompt first, the step's first N prompts)
and per validation (its greedy answers, `split: val`) are appended to `run_dir/samples.jsonl`:

    {"step": 3, "split": "train", "prompt": "...", "response": "...", "reward": 1.0,
     "finish_reason": "eos", "num_tokens": 12, "source": "train.parquet:41"}

`prompt` is the text the model saw (after the chat template), `response` the generated ids
decoded by the run's tokenizer with special tokens kept (an end token shows as written; a
synthetic task's tokenizer writes ids), `finish_reason` is `eos` (the model's end id, see
`rl3d.rollout.stops`), `stop` (another of `rollout.stop_token_ids`) or `length`, `num_tokens`
the response's length. With the TensorBoard tracker the same rows go to its Text tab
(`samples/train`, `samples/val`). A resumed run drops the rows after its checkpoint's step
(`rl3d.logging.metrics.drop_rows_after`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SAMPLES_NAME = "samples.jsonl"
FINISH_EOS = "eos"


def pick_rows(uids: list[Any], num: int) -> list[int]:
    """Up to `num` row indices: the first row of each prompt (by uid) in order, then the others."""
    seen: set[Any] = set()
    first, rest = [], []
    for i, uid in enumerate(uids):
        (rest if uid in seen else first).append(i)
        seen.add(uid)
    return (first + rest)[:num]


def sample_records(
    batch: Any, tokenizer: Any, *, step: int, split: str, num: int, end_ids: Iterable[int]
) -> list[dict[str, Any]]:
    """The rows `pick_rows` chooses of a scored rollout batch, as `samples.jsonl` records."""
    ends = set(end_ids)
    records = []
    for i in pick_rows(batch["uid"].tolist(), num):
        ids = [int(t) for t in batch["response_ids"][i]]
        reason = batch["finish_reason"][i]
        if reason == "stop" and ids and ids[-1] in ends:
            reason = FINISH_EOS
        records.append(
            {
                "step": step,
                "split": split,
                "prompt": batch["prompt_text"][i],
                "response": tokenizer.decode(ids, skip_special_tokens=False),
                "reward": float(batch["score"][i]),
                "finish_reason": reason,
                "num_tokens": len(ids),
                "source": batch["source"][i],
            }
        )
    return records


def as_markdown(records: list[dict[str, Any]]) -> str:
    """TensorBoard's text tab renders markdown: each sample's prompt and response as code."""
    parts = []
    for r in records:
        head = f"**reward {r['reward']:.4g}**, {r['finish_reason']}, {r['num_tokens']} tokens ({r['source']})"
        parts.append(f"{head}\n\n    {_indent(r['prompt'])}\n\n    {_indent(r['response'])}")
    return "\n\n---\n\n".join(parts)


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")


class SamplesLog:
    """Appends a batch's samples to `run_dir/samples.jsonl` and to text sinks (`log_text`)."""

    def __init__(self, run_dir: Path, tokenizer: Any, *, num: int, end_ids: Iterable[int], text_sinks=()):
        self.path = Path(run_dir) / SAMPLES_NAME
        self.tokenizer, self.num, self.end_ids = tokenizer, num, frozenset(end_ids)
        self.text_sinks = list(text_sinks)

    def log(self, step: int, batch: Any, *, split: str = "train") -> None:
        records = sample_records(
            batch, self.tokenizer, step=step, split=split, num=self.num, end_ids=self.end_ids
        )
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        for sink in self.text_sinks:
            sink.log_text(f"samples/{split}", as_markdown(records), step)


def last_sample(run_dir: Path, split: str = "train") -> dict[str, Any] | None:
    """The first `split` record of the last step in `run_dir/samples.jsonl` (None: no samples)."""
    path = Path(run_dir) / SAMPLES_NAME
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line of a killed run
            continue
        if record.get("split") == split and (last is None or record["step"] != last["step"]):
            last = record
    return last
