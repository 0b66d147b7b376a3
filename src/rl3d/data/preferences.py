"""Synthetic preference pairs labelled by a hidden rule, so that the whole RLHF chain (pairs ->
reward model -> RL against the model) is checkable on CPU: the RL run is judged by the rule,
which the reward model only ever saw through the labels.

A pair is one prompt of a synthetic task (`rl3d.data.synthetic`) and two responses of
`response_length` tokens over the whole 256-id vocabulary (what an untrained policy samples).
Each response is drawn with its own target share `q ~ U(0, 1)` of rule-satisfying tokens, so
pairs span the rule's whole range; pairs whose rule scores differ by less than `min_gap` are
redrawn (a tie carries no preference). Rules:

- ``parity_repeat`` (a reward, higher is better): the `parity_repeat` task's own reward, the
  share of response tokens with the parity of the prompt's symbol; prompts are that task's
  (one symbol repeated). A tiny policy learns the rule itself with GRPO in ~100 steps (the demo).
- ``high_token_ids`` (a cost, lower is better): the share of response tokens in the upper half
  of the vocabulary (ids >= 128, `rl3d.rewards.registry.high_token_ids_cost`); a response is
  *unsafe* when that share exceeds `SAFETY_LIMIT` (labels `chosen_safe` / `rejected_safe`).

Parquet columns: ``prompt``, ``chosen``, ``rejected`` (token ids written as text, which the
synthetic tokenizer reads back exactly; `rl3d.data.tokenizer`), ``chosen_score``,
``rejected_score`` (the hidden rule's values, for analysis only: training reads neither) and,
for a cost rule, ``chosen_safe``, ``rejected_safe``.

    python -m rl3d.data.preferences --rule parity_repeat --num-pairs 4000 --out prefs.parquet
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rl3d.data.synthetic import get_synthetic_task

VOCAB = 256  # the synthetic tasks' vocabulary (tiny-llama, tiny-qwen2)
HIGH_TOKEN_ID = 128  # same boundary as rl3d.rewards.registry.HIGH_TOKEN_ID
SAFETY_LIMIT = 0.25  # high_token_ids: a response is unsafe above this share of high ids


@dataclass(frozen=True)
class PreferenceRule:
    """A hidden rule: `good(prompt_ids, token)` says whether a token satisfies it, and the rule's
    value of a response is the share of its tokens that do (`value`)."""

    name: str
    task: str  # the synthetic task whose prompts the pairs use
    good: Callable[[Sequence[int], int], bool]
    kind: str = "reward"  # "reward": more good tokens is better; "cost": the value is a cost
    limit: float | None = None  # cost rules: a response is unsafe when its value exceeds this

    def value(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        if not response_ids:
            return 0.0
        return sum(self.good(prompt_ids, int(t)) for t in response_ids) / len(response_ids)

    def prefers(self, prompt_ids: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
        """True when `a` is the better (reward) or safer (cost) response."""
        va, vb = self.value(prompt_ids, a), self.value(prompt_ids, b)
        return va > vb if self.kind == "reward" else va < vb


PREFERENCE_RULES: dict[str, PreferenceRule] = {
    rule.name: rule
    for rule in (
        PreferenceRule("parity_repeat", "parity_repeat", lambda p, t: t % 2 == p[0] % 2),
        PreferenceRule(
            "high_token_ids",
            "parity_repeat",
            lambda p, t: t >= HIGH_TOKEN_ID,
            kind="cost",
            limit=SAFETY_LIMIT,
        ),
    )
}


def get_preference_rule(name: str) -> PreferenceRule:
    if name not in PREFERENCE_RULES:
        raise ValueError(f"unknown preference rule {name!r}; known: {', '.join(sorted(PREFERENCE_RULES))}")
    return PREFERENCE_RULES[name]


def _response(rng: random.Random, rule: PreferenceRule, prompt: list[int], length: int) -> list[int]:
    q = rng.random()
    good = [t for t in range(VOCAB) if rule.good(prompt, t)]
    bad = [t for t in range(VOCAB) if not rule.good(prompt, t)]
    return [rng.choice(good) if rng.random() < q else rng.choice(bad) for _ in range(length)]


def make_preference_pairs(
    rule_name: str, num_pairs: int, *, seed: int = 0, response_length: int = 8, min_gap: float = 0.25
) -> list[dict]:
    """`num_pairs` rows (see the module docstring), the same for the same arguments anywhere."""
    rule = get_preference_rule(rule_name)
    task = get_synthetic_task(rule.task)
    prompts = task.make_prompts(num_pairs, seed)
    rng = random.Random(f"rl3d.preferences:{rule_name}:{seed}")
    rows = []
    for prompt in prompts:
        while True:
            a, b = (_response(rng, rule, prompt, response_length) for _ in range(2))
            if abs(rule.value(prompt, a) - rule.value(prompt, b)) >= min_gap:
                break
        chosen, rejected = (a, b) if rule.prefers(prompt, a, b) else (b, a)
        row = {
            "prompt": " ".join(map(str, prompt)),
            "chosen": " ".join(map(str, chosen)),
            "rejected": " ".join(map(str, rejected)),
            "chosen_score": rule.value(prompt, chosen),
            "rejected_score": rule.value(prompt, rejected),
        }
        if rule.limit is not None:
            row["chosen_safe"] = row["chosen_score"] <= rule.limit
            row["rejected_safe"] = row["rejected_score"] <= rule.limit
        rows.append(row)
    return rows


def write_preference_parquet(rows: list[dict], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)
    return path


def read_preference_parquet(path: str | Path) -> list[dict]:
    """The rows of a preference file; ValueError naming the file and the missing column."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: preference data needs columns prompt, chosen, rejected; missing {missing}")
    return table.to_pylist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rule", default="parity_repeat", choices=sorted(PREFERENCE_RULES))
    parser.add_argument("--num-pairs", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = make_preference_pairs(args.rule, args.num_pairs, seed=args.seed)
    write_preference_parquet(rows, args.out)
    print(f"wrote {len(rows)} {args.rule} pairs to {args.out}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
