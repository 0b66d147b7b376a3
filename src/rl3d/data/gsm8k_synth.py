"""GSM8K-style word problems that rl3d makes itself, in verl's RL parquet layout.

    python -m rl3d.data.gsm8k_synth --out data/gsm8k_synth [--steps 1 --max-number 5 --ops add]

writes ``train.parquet`` and ``val.parquet`` (distinct questions). Each row is what verl's GSM8K
preprocessing writes, with its own source:

- ``data_source``: ``rl3d/gsm8k_synth`` (scored by the GSM8K scorer: `rl3d.rewards.SOURCE_REWARDS`)
- ``prompt``: ``[{"role": "user", "content": question}]``; ``--instruction verl`` appends verl's
  instruction (`INSTRUCTION`, "Let's think step by step ... after ####"), ``--instruction TEXT``
  another; ``--system`` puts a system message first
- ``ability``: ``math``; ``reward_model``: ``{"style": "rule", "ground_truth": "<int>"}``
- ``extra_info``: ``{"split", "index", "question", "answer"}``, where ``answer`` is a worked
  solution in GSM8K's form, ending in ``#### <int>``.

The defaults are what `recipes/quickstart_cpu_smollm2_gsm8k.yaml` trains on: one addition with
numbers up to 5, the question alone (the recipe's system prompt shows the answer form).

Difficulty: ``steps`` is the number of operations after the starting amount, ``max_number``
bounds every number in the question, ``ops`` picks from ``add``, ``sub`` and ``mul`` (``mul``
makes the starting amount ``bags x items per bag``). Answers are never negative. The same seed
gives the same files.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("rl3d.data.gsm8k_synth")

SOURCE = "rl3d/gsm8k_synth"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's
OPS = ("add", "sub", "mul")

_NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Grace", "Leo", "Nina", "Jack", "Emma"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "coins", "eggs"]
_ADD = [
    "{name} buys {n} more {item}.",
    "A friend gives {name} {n} {item}.",
    "{name} finds {n} more {item}.",
]
_SUB = [
    "{name} gives {n} {item} to a friend.",
    "{name} loses {n} {item}.",
    "{name} uses {n} of the {item}.",
]


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps in GSM8K's form, ending in "#### <answer>"
    answer: int


def make_problem(rng: random.Random, *, steps: int, max_number: int, ops: tuple[str, ...] = OPS) -> Problem:
    """One problem: a starting amount and `steps` operations on it."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if "mul" in ops:
        bags, per_bag = rng.randint(2, max(2, min(max_number, 9))), rng.randint(2, max_number)
        total = bags * per_bag
        sentences = [f"{name} has {bags} bags with {per_bag} {item} in each bag."]
        work = [f"{name} starts with {bags} x {per_bag} = <<{bags}*{per_bag}={total}>>{total} {item}."]
    else:
        total = rng.randint(2, max_number)
        sentences, work = [f"{name} has {total} {item}."], []
    for _ in range(steps):
        n = rng.randint(1, max_number)
        subtract = "sub" in ops and (ops == ("sub",) or rng.random() < 0.5) and total > 1
        if subtract:
            n = min(n, total - 1)
            sentences.append(rng.choice(_SUB).format(name=name, n=n, item=item))
            work.append(f"{total} - {n} = <<{total}-{n}={total - n}>>{total - n}")
            total -= n
        else:
            sentences.append(rng.choice(_ADD).format(name=name, n=n, item=item))
            work.append(f"{total} + {n} = <<{total}+{n}={total + n}>>{total + n}")
            total += n
    question = " ".join([*sentences, f"How many {item} does {name} have now?"])
    solution = "\n".join([*work, f"#### {total}"])
    return Problem(question, solution, total)


def make_rows(
    num: int,
    *,
    seed: int,
    split: str,
    steps: int,
    max_number: int,
    ops: tuple[str, ...] = OPS,
    system: str | None = None,
    instruction: str = INSTRUCTION,
    exclude: set[str] | None = None,
) -> list[dict[str, Any]]:
    """`num` rows in verl's layout with distinct questions (none in `exclude`)."""
    _check(steps=steps, max_number=max_number, ops=ops)
    rng = random.Random(f"{seed}:{split}")
    seen = set(exclude or ())
    rows: list[dict[str, Any]] = []
    for _ in range(num * 50):
        if len(rows) == num:
            break
        problem = make_problem(rng, steps=steps, max_number=max_number, ops=ops)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        messages = [{"role": "system", "content": system}] if system else []
        content = f"{problem.question} {instruction}" if instruction else problem.question
        messages.append({"role": "user", "content": content})
        rows.append(
            {
                "data_source": SOURCE,
                "prompt": messages,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "question": problem.question,
                    "answer": problem.solution,
                },
            }
        )
    if len(rows) < num:
        raise ValueError(
            f"only {len(rows)} distinct {split} problems at steps={steps}, max_number={max_number}; "
            "ask for fewer or raise --max-number"
        )
    return rows


def _check(*, steps: int, max_number: int, ops: tuple[str, ...]) -> None:
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    if max_number < 2:
        raise ValueError(f"--max-number must be >= 2, got {max_number}")
    unknown = [op for op in ops if op not in OPS]
    if not ops or unknown:
        raise ValueError(f"--ops {','.join(ops)!r}: choose from {', '.join(OPS)}")


def write_splits(
    out: str | Path, *, num_train: int, num_val: int, seed: int, **difficulty: Any
) -> list[Path]:
    """Write ``train.parquet`` and ``val.parquet`` under `out`; their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = make_rows(num_train, seed=seed, split="train", **difficulty)
    val = make_rows(
        num_val, seed=seed, split="val", exclude={r["extra_info"]["question"] for r in train}, **difficulty
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", train), ("val", val)):
        path = Path(out) / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rl3d.data.gsm8k_synth", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--num-train", type=int, default=1024)
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1, help="operations after the starting amount")
    parser.add_argument("--max-number", type=int, default=5, help="largest number in a question")
    parser.add_argument("--ops", default="add", help=f"comma-separated, from {','.join(OPS)}")
    parser.add_argument("--system", default=None, help="a system message put before each question")
    parser.add_argument("--instruction", default="", help="appended to each question ('verl': verl's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        paths = write_splits(
            args.out,
            num_train=args.num_train,
            num_val=args.num_val,
            seed=args.seed,
            steps=args.steps,
            max_number=args.max_number,
            ops=tuple(op.strip() for op in args.ops.split(",") if op.strip()),
            system=args.system,
            instruction=INSTRUCTION if args.instruction == "verl" else args.instruction,
        )
    except (OSError, ValueError) as err:
        logger.error("%s", err)
        return 1
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
