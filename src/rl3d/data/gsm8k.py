"""Turn a local GSM8K jsonl file into the parquet file a recipe's `data.train_files` reads.

    python -m rl3d.data.gsm8k --src train.jsonl --dst train.parquet [--template TEMPLATE]

Each input line is ``{"question": ..., "answer": "<reasoning> #### <number>"}``. Output columns:
``prompt`` (the question through `--template`, which by default asks for the final answer after
``####``), ``answer`` (the final number as a string, commas removed: ``"1,200"`` -> ``"1200"``)
and ``solution`` (the full answer text). Lines that are not JSON objects, or lack a question
or a ``#### <number>`` answer, are reported with their line number and skipped; the command
fails if no line is usable. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

logger = logging.getLogger("rl3d.data.gsm8k")

DEFAULT_TEMPLATE = (
    "{question}\nSolve the problem step by step. End your reply with the final answer as a number "
    'on its own line, in the form "#### <number>".'
)

_FINAL = re.compile(r"####\s*(\S+)")


def final_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, without commas (ValueError if none)."""
    match = _FINAL.search(solution)
    if match is None:
        raise ValueError("no '#### <number>' in the answer")
    number = match.group(1).replace(",", "").rstrip(".")
    try:
        float(number)
    except ValueError:
        raise ValueError(f"the text after '####' is not a number: {match.group(1)!r}") from None
    return number


def convert(src: str | Path, dst: str | Path, *, template: str = DEFAULT_TEMPLATE) -> tuple[int, int]:
    """Write `dst` from `src`; returns (rows written, lines skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if "{question}" not in template:
        raise ValueError(f"--template {template!r} must contain '{{question}}'")
    rows: dict[str, list[str]] = {"prompt": [], "answer": [], "solution": []}
    skipped = 0
    with open(src, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                question, solution = record.get("question"), record.get("answer")
                if not isinstance(question, str) or not question.strip():
                    raise ValueError("missing 'question'")
                if not isinstance(solution, str):
                    raise ValueError("missing 'answer'")
                answer = final_answer(solution)
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                logger.warning("%s:%d: skipped: %s", src, line_no, err)
                skipped += 1
                continue
            rows["prompt"].append(template.format(question=question.strip()))
            rows["answer"].append(answer)
            rows["solution"].append(solution)
    if not rows["prompt"]:
        raise ValueError(f"{src}: no usable GSM8K lines ({skipped} skipped)")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), dst)
    return len(rows["prompt"]), skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl3d.data.gsm8k", description=__doc__.split("\n")[0])
    parser.add_argument("--src", required=True, help="GSM8K jsonl file (question, answer)")
    parser.add_argument("--dst", required=True, help="parquet file to write")
    parser.add_argument("--template", default=DEFAULT_TEMPLATE, help="prompt template with {question}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        written, skipped = convert(args.src, args.dst, template=args.template)
    except (OSError, ValueError) as err:
        logger.error("%s", err)
        return 1
    logger.info("wrote %d rows to %s (%d lines skipped)", written, args.dst, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
