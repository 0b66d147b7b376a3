"""Prompt datasets: parquet files (or a synthetic task) -> tokenized `PromptItem`s.

A row's prompt (`data.prompt_key`, a column or a dotted field path, see `rl3d.config.data`) is
text or chat messages:

- text goes through `data.template` (``str.format`` over the row's columns, so
  ``"{question}\nAnswer:"`` works) and ``tokenizer.encode(text)`` (an HF tokenizer adds its own
  special tokens, e.g. Llama's BOS);
- messages (``[{role, content}]``, verl's and TRL's layout), and text too with
  ``data.chat_template: always``, go through the tokenizer's chat template with the generation
  prompt, `data.system_prompt` first when the conversation has no system message; the result
  is encoded without added special tokens (the template writes its own). `prompt_text` is the
  framed text the model sees.

Files are read one row group at a time and only the columns the keys and the template need.
The answer is `data.answer_key` (unset: `answer`, else verl's `reward_model.ground_truth`) and the
data source `data.source_key` (`data_source`) when the file has it. The answer check of
`reward.fn_by_source` (``answer_check.by_source``) is called as ``check(answer, data_source)``,
the column is then required, and a source with no reward is a `DataError` naming the file, row
and source (a recipe error, never a skipped row).

Errors of the *recipe* (a missing file, a column missing or of the wrong type, a template naming
a column the file lacks, a chat template the tokenizer does not have) raise `DataError` naming
the file and the key (`rl3d.data.columns.check_layout`, which the preflight runs too). Errors of
a *row* are bad rows:

- the prompt or another template column is null; the prompt is neither a string nor a list of
  messages; a message is not ``{role, content}`` with a known role and string content;
- the formatted prompt is empty (whitespace only) or fails to tokenize;
- it has more than `max_prompt_length` tokens. Such prompts are *rejected*, not truncated: a
  cut question is a different question, and its reward would be noise;
- with an `answer_check` (the reward needs answers, see `rl3d.rewards.answer_check_for`): the
  answer is null or `answer_check` raises ValueError/TypeError on it;
- with an image column (`data.image_key`, `rl3d.data.images`): an image is neither bytes nor a
  path, does not decode, or the framed prompt's `data.image_placeholder`s do not count the images.

With ``on_bad_row: skip`` each bad row is logged with ``file:row`` (rows count from 0 within
each file), recorded in `dataset.bad_rows` and skipped; with ``on_bad_row: error`` the first one
raises `DataError`. A dataset with no usable row is always an error.

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

from rl3d.data.columns import answer_key_of, check_layout, column_of, messages_of, type_at, value_at
from rl3d.data.errors import DataError
from rl3d.data.images import ImageRef, check_image_column, check_row_images, image_refs
from rl3d.data.synthetic import get_synthetic_task

logger = logging.getLogger(__name__)

_MAX_LOGGED_BAD_ROWS = 20


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in the dataset
    prompt_ids: list[int]
    prompt_text: str
    answer: Any
    source: str  # "file:row" (row from 0) or "synthetic:<task>:<i>"
    data_source: str | None = None  # the row's `data.source_key` column, when the file has one
    messages: list[dict[str, str]] | None = None  # a chat row's messages, as the template framed them
    images: tuple[ImageRef, ...] = ()  # encoded bytes or absolute paths (`rl3d.data.images`)


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
        # the check of reward.fn_by_source: called with the row's data source too
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
        schema = parquet.schema_arrow
        messages = check_layout(
            path, schema, cfg, template_columns=self.template_cols, needs_answer=self.answer_check is not None
        )
        if messages or cfg.chat_template == "always":
            self._check_chat_template(path)
        image_key = check_image_column(path, schema, cfg)
        answer_key = answer_key_of(cfg, schema)
        answer_key = answer_key if answer_key and type_at(schema, answer_key) is not None else None
        source_key = cfg.source_key if type_at(schema, cfg.source_key) is not None else None
        if self.by_source and source_key is None:
            raise DataError(
                f"{path}: reward.fn_by_source needs each row's source, but the file has no column "
                f"{cfg.source_key!r} (data.source_key); columns: {', '.join(schema.names)}"
            )
        keys = [k for k in (cfg.prompt_key, answer_key, source_key, image_key) if k]
        wanted = [column_of(k, schema.names) for k in keys] + ([] if messages else self.template_cols)
        columns = list(dict.fromkeys(wanted))
        row = 0
        for group in range(parquet.num_row_groups):
            for record in parquet.read_row_group(group, columns=columns).to_pylist():
                self._add_row(record, f"{path}:{row}", answer_key, source_key, image_key)
                row += 1

    def _check_chat_template(self, path: str) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{path}: the prompts need a chat template (data.chat_template: {self.cfg.chat_template}), "
                f"but the tokenizer has none ({type(self.tokenizer).__name__}; data.tokenizer names one)"
            )

    def _add_row(
        self,
        record: dict[str, Any],
        source: str,
        answer_key: str | None,
        source_key: str | None,
        image_key: str | None,
    ):
        data_source = value_at(record, source_key) if source_key else None
        try:
            text, prompt_ids, answer = self._parse_row(record, answer_key, data_source)
            images = self._images(record, text, source, image_key)
        except _BadRow as bad:
            self._bad(source, str(bad))
            return
        except LookupError as err:  # reward.fn_by_source has no reward for this row's source
            raise DataError(f"{source}: {err}") from None
        prompt = value_at(record, self.cfg.prompt_key)
        messages = self._with_system(messages_of(prompt)) if isinstance(prompt, list) else None
        self.items.append(
            PromptItem(len(self.items), prompt_ids, text, answer, source, data_source, messages, images)
        )

    def _images(self, record: dict[str, Any], text: str, source: str, image_key: str | None):
        """The row's images, each decoded once to check it; placeholders counted in the framed text."""
        if image_key is None:
            return ()
        try:
            refs = image_refs(value_at(record, image_key), Path(source.rsplit(":", 1)[0]).parent)
            check_row_images(refs, [text], self.cfg)
        except ValueError as err:
            raise _BadRow(str(err)) from None
        return tuple(refs)

    def _prompt_text(self, record: dict[str, Any]) -> tuple[str, bool]:
        """The prompt as text, and whether it is already framed by the chat template."""
        cfg = self.cfg
        prompt = value_at(record, cfg.prompt_key)
        if prompt is None:
            raise _BadRow(f"missing prompt (column {cfg.prompt_key!r} is null)")
        if isinstance(prompt, list):
            try:
                return self._chat(messages_of(prompt)), True
            except ValueError as err:
                raise _BadRow(f"column {cfg.prompt_key!r}: {err}") from None
        if not isinstance(prompt, str):
            raise _BadRow(
                f"prompt is {type(prompt).__name__}, not a string or a list of messages "
                f"(column {cfg.prompt_key!r})"
            )
        for column in self.template_cols:
            if record[column] is None:
                raise _BadRow(f"column {column!r} used by data.template is null")
        try:
            text = cfg.template.format(**record)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise _BadRow(f"data.template cannot format this row: {err!r}") from None
        if not text.strip():
            raise _BadRow("empty prompt after applying data.template")
        if cfg.chat_template == "always":
            return self._chat([{"role": "user", "content": text}]), True
        return text, False

    def _with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.cfg.system_prompt is not None and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        return messages

    def _chat(self, messages: list[dict[str, str]]) -> str:
        messages = self._with_system(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (e.g. roles must alternate)
            raise _BadRow(f"the chat template failed: {err!r}") from None

    def _parse_row(
        self, record: dict[str, Any], answer_key: str | None, data_source: str | None
    ) -> tuple[str, list[int], Any]:
        cfg = self.cfg
        text, framed = self._prompt_text(record)
        try:
            # the chat template writes its own special tokens (a BOS among them where the model has one)
            ids = (
                self.tokenizer.encode(text, add_special_tokens=False)
                if framed
                else self.tokenizer.encode(text)
            )
            prompt_ids = [int(t) for t in ids]
        except Exception as err:
            raise _BadRow(f"tokenizer failed: {err!r}") from None
        if not prompt_ids:
            raise _BadRow("prompt tokenizes to no tokens")
        if len(prompt_ids) > cfg.max_prompt_length:
            raise _BadRow(
                f"prompt has {len(prompt_ids)} tokens > data.max_prompt_length {cfg.max_prompt_length}"
            )
        answer = value_at(record, answer_key) if answer_key else None
        if self.answer_check is not None:
            if answer is None:
                raise _BadRow(f"missing answer (column {answer_key!r} is null)")
            try:
                answer = (
                    self.answer_check(answer, data_source) if self.by_source else self.answer_check(answer)
                )
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
