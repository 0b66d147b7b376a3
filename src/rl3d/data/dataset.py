"""Prompt datasets: parquet files (or a synthetic task) -> tokenized `PromptItem`s.

Parquet rows become prompts through `data.template` (``str.format`` over the row's columns, so
``"{question}\nAnswer:"`` works) and ``tokenizer.encode(text)`` (an HF tokenizer adds its own
special tokens, e.g. Llama's BOS; no chat template is applied). Files are read one row group at a time and
only the columns the template, `prompt_key` and `answer_key` need.

Errors of the *recipe* (a missing file, a template naming a column the file lacks, a bad
template) raise `DataError` naming the file and the column. Errors of a *row* are bad rows:

- the prompt (`prompt_key`) or another template column is null; the prompt is not a string;
- the formatted prompt is empty (whitespace only) or fails to tokenize;
- it has more than `max_prompt_length` tokens. Such prompts are *rejected*, not truncated: a
  cut question is a different question, and its reward would be noise;
- with an `answer_check` (the reward needs answers, see `rl3d.rewards.answer_check_for`): the
  answer is null or `answer_check` raises ValueError/TypeError on it.

With ``on_bad_row: skip`` each bad row is logged with ``file:row`` (rows count from 0 within
each file), recorded in `dataset.bad_rows` and skipped; with ``on_bad_row: error`` the first one
raises `DataError`. A dataset with no usable row is always an error.

An answer check that routes by source (``answer_check.by_source``, the check of
`reward.fn_by_source`) is called as ``check(answer, data_source)`` with the row's
`SOURCE_COLUMN`, which the files must then have; a source with no reward is a `DataError`
naming the file, row and source (a recipe error, never skipped).

`PromptItem.index` is the item's position in the dataset (``dataset[i].index == i``); the
sampler and the rewards refer to prompts by it. `source` is where it came from (``file:row``).

`cfg` is the recipe's `rl3d.config.DataConfig` (not imported: the config layer sits above data
and rewards, which it validates).
"""

from __future__ import annotations

import logging
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from rl3d.data.synthetic import get_synthetic_task

logger = logging.getLogger(__name__)

_MAX_LOGGED_BAD_ROWS = 20
SOURCE_COLUMN = "data_source"  # verl's: which dataset a row comes from, so which reward scores it


class DataError(ValueError):
    """The data cannot be used as configured; the message names the file (and row or column)."""


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in the dataset
    prompt_ids: list[int]
    prompt_text: str
    answer: Any
    source: str  # "file:row" (row from 0) or "synthetic:<task>:<i>"
    data_source: str | None = None  # the row's SOURCE_COLUMN, read when the reward routes by it


@dataclass
class PromptDataset(Sequence[PromptItem]):
    """A list of `PromptItem`s plus what was skipped while loading."""

    items: list[PromptItem]
    bad_rows: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    files: list[str] = field(default_factory=list)

    @property
    def num_bad_rows(self) -> int:
        return len(self.bad_rows)

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> PromptItem: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptItem]: ...
    def __getitem__(self, i: int | slice) -> PromptItem | list[PromptItem]:
        return self.items[i]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)


def load_prompt_dataset(
    cfg: Any, tokenizer: Any, *, answer_check: Callable[[Any], Any] | None = None
) -> PromptDataset:
    """The prompts of `cfg.train_files`, or of `cfg.synthetic` when there are no files.

    `answer_check(raw_answer) -> answer` marks the answer as required: it normalises each row's
    answer and raises ValueError/TypeError for one the reward could not use.
    """
    if not cfg.train_files:
        assert cfg.synthetic is not None, "DataConfig guarantees files or a synthetic block"
        return _synthetic_dataset(cfg, tokenizer)
    loader = _ParquetLoader(cfg, tokenizer, answer_check)
    for path in cfg.train_files:
        loader.load_file(path)
    dataset = PromptDataset(items=loader.items, bad_rows=loader.bad_rows, files=list(cfg.train_files))
    if dataset.num_bad_rows > _MAX_LOGGED_BAD_ROWS:
        logger.warning("... %d more bad rows not shown", dataset.num_bad_rows - _MAX_LOGGED_BAD_ROWS)
    if not dataset.items:
        first = f"; first: {dataset.bad_rows[0][0]}: {dataset.bad_rows[0][1]}" if dataset.bad_rows else ""
        raise DataError(
            f"no usable prompts in {', '.join(cfg.train_files)} ({dataset.num_bad_rows} bad rows{first})"
        )
    logger.info(
        "loaded %d prompts from %d file(s), skipped %d bad rows",
        len(dataset),
        len(cfg.train_files),
        dataset.num_bad_rows,
    )
    return dataset


def template_columns(template: str) -> list[str]:
    """The columns a ``str.format`` template reads (``{a.b}`` and ``{a[0]}`` read column ``a``)."""
    columns: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DataError(f"data.template {template!r}: {err}") from None
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        base = field_name.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise DataError(f"data.template {template!r}: fields must name columns, e.g. '{{prompt}}'")
        if base not in columns:
            columns.append(base)
    return columns


class _ParquetLoader:
    def __init__(self, cfg: Any, tokenizer: Any, answer_check: Callable[[Any], Any] | None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.answer_check = answer_check
        self.by_source = bool(getattr(answer_check, "by_source", False))
        self.template_cols = template_columns(cfg.template)
        self.items: list[PromptItem] = []
        self.bad_rows: list[tuple[str, str]] = []

    def load_file(self, path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cfg = self.cfg
        if not Path(path).is_file():
            raise DataError(f"data.train_files: {path}: no such file")
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: not a readable parquet file: {err}") from None
        names = set(parquet.schema_arrow.names)
        available = ", ".join(parquet.schema_arrow.names)
        for column in self.template_cols:
            if column not in names:
                raise DataError(
                    f"{path}: data.template {cfg.template!r} names column {column!r}, "
                    f"which the file lacks; columns: {available}"
                )
        if cfg.prompt_key not in names:
            raise DataError(f"{path}: no column {cfg.prompt_key!r} (data.prompt_key); columns: {available}")
        has_answer = cfg.answer_key in names
        if self.answer_check is not None and not has_answer:
            raise DataError(
                f"{path}: the reward needs answers but the file has no column {cfg.answer_key!r} "
                f"(data.answer_key); columns: {available}"
            )
        if self.by_source and SOURCE_COLUMN not in names:
            raise DataError(
                f"{path}: reward.fn_by_source needs a {SOURCE_COLUMN!r} column; columns: {available}"
            )
        wanted = [cfg.prompt_key, *self.template_cols, *([cfg.answer_key] if has_answer else [])]
        wanted += [SOURCE_COLUMN] if self.by_source else []
        columns = list(dict.fromkeys(wanted))
        row = 0
        for group in range(parquet.num_row_groups):
            for record in parquet.read_row_group(group, columns=columns).to_pylist():
                self._add_row(record, f"{path}:{row}")
                row += 1

    def _add_row(self, record: dict[str, Any], source: str) -> None:
        data_source = record.get(SOURCE_COLUMN)
        try:
            text, prompt_ids, answer = self._parse_row(record, data_source)
        except _BadRow as bad:
            self._bad(source, str(bad))
            return
        except LookupError as err:  # the routed answer check: this source has no reward
            raise DataError(f"{source}: {err}") from None
        self.items.append(PromptItem(len(self.items), prompt_ids, text, answer, source, data_source))

    def _parse_row(self, record: dict[str, Any], data_source: str | None) -> tuple[str, list[int], Any]:
        cfg = self.cfg
        prompt = record[cfg.prompt_key]
        if prompt is None:
            raise _BadRow(f"missing prompt (column {cfg.prompt_key!r} is null)")
        if not isinstance(prompt, str):
            raise _BadRow(f"prompt is {type(prompt).__name__}, not a string (column {cfg.prompt_key!r})")
        for column in self.template_cols:
            if record[column] is None:
                raise _BadRow(f"column {column!r} used by data.template is null")
        try:
            text = cfg.template.format(**record)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise _BadRow(f"data.template cannot format this row: {err!r}") from None
        if not text.strip():
            raise _BadRow("empty prompt after applying data.template")
        try:
            prompt_ids = [int(t) for t in self.tokenizer.encode(text)]
        except Exception as err:
            raise _BadRow(f"tokenizer failed: {err!r}") from None
        if not prompt_ids:
            raise _BadRow("prompt tokenizes to no tokens")
        if len(prompt_ids) > cfg.max_prompt_length:
            raise _BadRow(
                f"prompt has {len(prompt_ids)} tokens > data.max_prompt_length {cfg.max_prompt_length}"
            )
        answer = record.get(cfg.answer_key)
        if self.answer_check is not None:
            if answer is None:
                raise _BadRow(f"missing answer (column {cfg.answer_key!r} is null)")
            try:
                by_source = (data_source,) if self.by_source else ()
                answer = self.answer_check(answer, *by_source)
            except (ValueError, TypeError) as err:
                raise _BadRow(f"unparsable answer {answer!r}: {err}") from None
        return text, prompt_ids, answer

    def _bad(self, source: str, reason: str) -> None:
        if self.cfg.on_bad_row == "error":
            raise DataError(f"{source}: {reason} (data.on_bad_row: error)")
        self.bad_rows.append((source, reason))
        if len(self.bad_rows) <= _MAX_LOGGED_BAD_ROWS:
            logger.warning("skipping bad row %s: %s", source, reason)


class _BadRow(Exception):
    pass


def _synthetic_dataset(cfg: Any, tokenizer: Any) -> PromptDataset:
    syn = cfg.synthetic
    assert syn is not None
    try:
        task = get_synthetic_task(syn.task)
    except ValueError as err:
        raise DataError(f"data.synthetic.task: {err}") from None
    if task.prompt_length > cfg.max_prompt_length:
        raise DataError(
            f"data.synthetic.task {task.name!r} makes {task.prompt_length}-token prompts "
            f"> data.max_prompt_length {cfg.max_prompt_length}"
        )
    if len(tokenizer) < task.min_vocab_size:
        raise DataError(
            f"data.synthetic.task {task.name!r} needs a vocabulary of >= {task.min_vocab_size} ids, "
            f"the tokenizer has {len(tokenizer)}"
        )
    items = [
        PromptItem(i, ids, tokenizer.decode(ids), task.answer(ids), f"synthetic:{task.name}:{i}")
        for i, ids in enumerate(task.make_prompts(syn.num_prompts, syn.seed))
    ]
    logger.info("synthetic task %s: %d prompts (seed %d)", task.name, len(items), syn.seed)
    return PromptDataset(items=items)
