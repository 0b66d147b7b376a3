"""The actor's supervised warm start (`actor.warm_start`, `rl3d.config.warm_start`): SFT on a few
demonstrations before RL, the cold start of ReTool-style agentic RL.

It runs on every rank of the actor's pool while the run is built (`rl3d.controller.rank`),
right after the actor's model exists and before any other role copies it, so the reference
(the KL anchor) and a critic start from the warmed policy, as after a separate SFT job. It
trains through the actor's own megatron model, optimizer and layout (any TP/PP/DP): each step
takes `batch_size` demonstrations (a seeded shuffle, cycled), deals each DP rank its share, and
makes one optimizer step on the token-mean NLL of the response tokens whose loss mask is 1.
Observation tokens (a tool's result) are in the context but outside the loss, exactly as
`response_mask` 0 keeps them out of the policy loss in RL. Afterwards the optimizer's learning
rates and scheduler are as before and its state is cleared: RL starts with a fresh Adam.

Demonstration rows (from a function `fn(num_examples=, seed=, **options)` or a .jsonl/.json/
.parquet file):

    {"prompt_ids": [...], "segments": [{"ids": [...], "loss": true}, {"ids": [...], "loss": false}]}
    {"prompt": "text", "segments": [{"text": "...", "loss": true}, ...], "eos": true}
    {"prompt": "text", "response": "text"}                       # plain SFT: every token trained

Text is tokenized with the run's tokenizer, one segment at a time (as the tool loop appends
observations: never re-tokenized across a boundary). A response that does not end with EOS gets
one (trained) unless the row sets ``"eos": false``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl3d.config.warm_start import WarmStartConfig
from rl3d.data.tokenizer import pad_id_of
from rl3d.single_controller.batch import PAD_VALUES, DataBatch

logger = logging.getLogger(__name__)
WARM_START_LOG = "warm_start.jsonl"  # run_dir file: one row per SFT step


@dataclass(frozen=True)
class Demonstration:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1: trained (policy tokens), 0: context only (observations)


def load_rows(ws: WarmStartConfig) -> list[dict]:
    """The demonstration rows of `ws.data` (the first `num_examples` of a file)."""
    if ws.is_function:
        from rl3d.utils.imports import import_object

        fn = import_object(ws.data, what="actor.warm_start.data")
        extra = {} if ws.num_examples is None else {"num_examples": ws.num_examples}
        rows = list(fn(seed=ws.seed, **extra, **ws.options))
    elif ws.data.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(ws.data).to_pylist()
    elif ws.data.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(ws.data).read_text().splitlines() if line.strip()]
    else:
        rows = json.loads(Path(ws.data).read_text())
    rows = rows if ws.num_examples is None else rows[: ws.num_examples]
    if not rows:
        raise ValueError(f"actor.warm_start.data: {ws.data!r} gave no demonstrations")
    return rows


def _ids(part: dict, tokenizer: Any, where: str) -> list[int]:
    if "ids" in part:
        return [int(t) for t in part["ids"]]
    if "text" in part:
        return list(tokenizer.encode(part["text"], add_special_tokens=False))
    raise ValueError(f"{where}: a segment needs 'ids' or 'text', got keys {sorted(part)}")


def demonstration(row: dict, tokenizer: Any, where: str = "demonstration") -> Demonstration:
    """One row as token ids and a loss mask (see the module docstring for the row forms)."""
    if "prompt_ids" in row:
        prompt = [int(t) for t in row["prompt_ids"]]
    elif "prompt" in row:
        prompt = list(tokenizer.encode(row["prompt"]))
    else:
        raise ValueError(f"{where}: needs 'prompt_ids' or 'prompt'")
    if "segments" in row:
        segments = row["segments"]
    elif "response" in row:
        segments = [{"text": row["response"], "loss": True}]
    else:
        raise ValueError(f"{where}: needs 'segments' or 'response'")
    response, mask = [], []
    for j, part in enumerate(segments):
        ids = _ids(part, tokenizer, f"{where}.segments[{j}]")
        response += ids
        mask += [int(bool(part.get("loss", True)))] * len(ids)
    eos = tokenizer.eos_token_id
    if row.get("eos", True) and eos is not None and (not response or response[-1] != eos):
        response, mask = response + [eos], mask + [1]
    if not prompt or not sum(mask):
        raise ValueError(f"{where}: empty prompt or no trained token")
    return Demonstration(prompt, response, mask)


def demonstrations(rows: list[dict], tokenizer: Any) -> tuple[list[Demonstration], int]:
    """The usable demonstrations of `rows` and how many were not: a bad row is reported (its
    index and why) and counted, never fatal, unless no row is usable."""
    demos, bad = [], 0
    for i, row in enumerate(rows):
        where = f"actor.warm_start.data[{i}]"
        try:
            demos.append(demonstration(row, tokenizer, where))
        except (ValueError, TypeError, KeyError) as err:
            bad += 1
            logger.warning("warm start: skipping %s: %s", where, err)
    if not demos:
        raise ValueError(f"actor.warm_start.data: none of the {len(rows)} rows is a usable demonstration")
    return demos, bad


def demonstration_batch(
    demos: list[Demonstration], *, pad_token_id: int, width: tuple[int, int]
) -> DataBatch:
    """[left-padded prompt | right-padded response] as the actor trains on rollouts, with the
    loss mask as `response_mask` (observations: attention 1, loss 0)."""
    P, R = width
    B = len(demos)
    ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    loss_mask = torch.zeros(B, R, dtype=torch.long)
    for i, d in enumerate(demos):
        ids[i, P - len(d.prompt_ids) : P] = torch.tensor(d.prompt_ids)
        ids[i, P : P + len(d.response_ids)] = torch.tensor(d.response_ids)
        attention[i, P - len(d.prompt_ids) : P + len(d.response_ids)] = 1
        loss_mask[i, : len(d.loss_mask)] = torch.tensor(d.loss_mask)
    return DataBatch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "responses": ids[:, P:].clone(),
            "response_mask": loss_mask,
        },
        info={PAD_VALUES: {"input_ids": pad_token_id, "responses": pad_token_id}},
    )


def step_rows(num_rows: int, *, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Row indices of each step: epochs of a seeded shuffle, cycled."""
    rng = random.Random(f"rl3d.warm_start:{seed}")
    order: list[int] = []
    out = []
    for _ in range(steps):
        while len(order) < batch_size:
            epoch = list(range(num_rows))
            rng.shuffle(epoch)
            order += epoch
        out.append(order[:batch_size])
        order = order[batch_size:]
    return out


def sft_loss(role: Any):
    """Token-mean NLL over the trained response tokens (`loss_of` for the `MegatronEngine` `role`;
    log-probs over the TP-sharded vocabulary, as the policy loss reads them)."""
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy

    def loss_of(output: torch.Tensor, micro: DataBatch):
        logits = role.response_slice(output, micro)
        tp_group, vocab = role.groups.tp_group, role.spec.vocab_size
        logp, _ = vocab_parallel_logprobs_entropy(logits, micro["responses"], tp_group, vocab_size=vocab)
        mask = micro["response_mask"].to(logp.dtype)
        nll = -(logp * mask).sum()
        loss = nll / mask.sum().clamp(min=1.0)
        return loss, {"warm_start/loss": loss.detach(), "nll": nll.detach(), "tokens": mask.sum()}

    return loss_of


def fresh_optimizer_state(optimizer: Any) -> None:
    """Forget Adam's moments and step counts (a new optimizer's state, created lazily)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.optimizer.state.clear()


def warm_start(actor: Any, cfg: Any, tokenizer: Any, run_dir: Path | None = None) -> list[dict[str, float]]:
    """SFT of `actor` (an `ActorRolloutWorker` on this rank) per `cfg.actor.warm_start`;
    collective over the actor's pool. The per-step metrics (on the collector rank; `run_dir`:
    also written to warm_start.jsonl there), else []."""
    ws, role, groups = cfg.actor.warm_start, actor.role, actor.groups
    rows = load_rows(ws)
    demos, bad = demonstrations(rows, tokenizer)
    width = (max(len(d.prompt_ids) for d in demos), max(len(d.response_ids) for d in demos))
    pad = pad_id_of(tokenizer)
    dp, dp_rank = groups.layout.d, groups.dp_rank
    local = ws.batch_size // dp
    collector = groups.holds_outputs and dp_rank == 0
    lrs = [g["lr"] for g in role.optimizer.param_groups]
    scheduler, role.scheduler = role.scheduler, None  # SFT steps are not RL steps
    for g in role.optimizer.param_groups:
        g["lr"] = ws.lr
    history: list[dict[str, float]] = []
    loss_of = sft_loss(role)
    start = time.perf_counter()
    try:
        for step, chosen in enumerate(
            step_rows(len(demos), steps=ws.steps, batch_size=ws.batch_size, seed=ws.seed)
        ):
            mine = [demos[i] for i in chosen[dp_rank * local : (dp_rank + 1) * local]]
            batch = demonstration_batch(mine, pad_token_id=pad, width=width)
            out = role.train_minibatches(
                batch,
                mini_batch_size=ws.batch_size,
                micro_batch_size=cfg.actor.micro_batch_size,
                epochs=1,
                loss_of=loss_of,
                count_unit=lambda m: float(m["response_mask"].sum()),
            )
            if groups.is_last_stage:  # the step's token-mean NLL over every DP rank's share
                sums = [(r["nll"], r["tokens"]) for r in out if "nll" in r]
                total = torch.tensor([sum(n for n, _ in sums), sum(t for _, t in sums)], device=groups.device)
                torch.distributed.all_reduce(total, group=groups.dp_group)
                row = {"warm_start/step": step + 1, "warm_start/loss": float(total[0] / total[1])}
                row["warm_start/bad_rows"] = float(bad)
                row["warm_start/seconds"] = time.perf_counter() - start
                row |= {f"warm_start/{k}": r[k] for r in out for k in ("grad_norm",) if k in r}
            if collector:
                history.append(row)
                if step == 0 or (step + 1) % 10 == 0 or step + 1 == ws.steps:
                    logger.info(
                        "warm start: SFT step %d/%d loss %.4f", step + 1, ws.steps, row["warm_start/loss"]
                    )
    finally:
        role.scheduler = scheduler
        for g, lr in zip(role.optimizer.param_groups, lrs):
            g["lr"] = lr
        fresh_optimizer_state(role.optimizer)
    if collector and run_dir is not None:
        with open(Path(run_dir) / WARM_START_LOG, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in history)
    return history
