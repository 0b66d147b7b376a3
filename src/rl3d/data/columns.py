"""Parquet columns as the data config names them: dotted keys, column types, chat messages.

A key names a column or, with dots, a field of a struct column (`reward_model.ground_truth`);
a column whose own name holds the dot wins. `check_layout` checks one file's schema against
the config before any row is read (the loader and the preflight both call it), so a whole
column of the wrong type is a recipe error naming the file and the key, while a single bad
value is a bad row (`rl3d.data.dataset`).
"""

from __future__ import annotations

from typing import Any

from rl3d.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
VERL_ANSWER_KEY = "reward_model.ground_truth"
DEFAULT_ANSWER_KEYS = ("answer", VERL_ANSWER_KEY)  # data.answer_key unset: the first a file has


def column_of(key: str, names: list[str]) -> str:
    """The top-level column `key` reads."""
    return key if key in names else key.split(".", 1)[0]


def value_at(record: dict[str, Any], key: str) -> Any:
    """`record`'s value at `key` (None where a struct on the way is null)."""
    if key in record:
        return record[key]
    head, *fields = key.split(".")
    value = record[head]
    for name in fields:
        if value is None:
            return None
        value = value[name]
    return value


def type_at(schema: Any, key: str) -> Any:
    """The arrow type at `key` in `schema`, or None when the file has no such column or field."""
    import pyarrow as pa

    if key in schema.names:
        return schema.field(key).type
    head, *fields = key.split(".")
    if head not in schema.names:
        return None
    kind = schema.field(head).type
    for name in fields:
        if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
            return None
        kind = kind.field(name).type
    return kind


def is_messages_type(kind: Any) -> bool:
    """A list of structs with `role` and `content` (verl's and TRL's conversational prompt)."""
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    item = kind.value_type
    return pa.types.is_struct(item) and all(item.get_field_index(k) >= 0 for k in ("role", "content"))


def _is_text(kind: Any) -> bool:
    """A string column (or one of nulls only: every row is then a bad row, not a layout)."""
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)


def _is_nested(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_nested(kind)


def messages_of(value: Any) -> list[dict[str, str]]:
    """A prompt's chat messages as plain dicts; ValueError naming the first bad message."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"prompt is {type(value).__name__}, not a non-empty list of {{role, content}}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {type(message).__name__}, not a {{role, content}} mapping")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) has content {type(content).__name__}, not a string")
        out.append({"role": role, "content": content})
    return out


def answer_key_of(cfg: Any, schema: Any) -> str | None:
    """`data.answer_key`, or the first of `DEFAULT_ANSWER_KEYS` the file has (None: none)."""
    if cfg.answer_key is not None:
        return cfg.answer_key
    return next((key for key in DEFAULT_ANSWER_KEYS if type_at(schema, key) is not None), None)


def check_layout(
    path: str, schema: Any, cfg: Any, *, template_columns: list[str], needs_answer: bool
) -> bool:
    """DataError unless `path`'s columns can give prompts (and answers when `needs_answer`) as
    `cfg` reads them; returns whether the prompt column holds chat messages."""
    names = list(schema.names)

    def missing(key: str, what: str, why: str = "") -> DataError:
        return DataError(f"{path} has no column {key!r} ({what}){why}; its columns: {', '.join(names)}")

    prompt = type_at(schema, cfg.prompt_key)
    if prompt is None:
        raise missing(cfg.prompt_key, "data.prompt_key")
    messages = is_messages_type(prompt)
    if messages and cfg.chat_template == "never":
        raise DataError(
            f"{path}: column {cfg.prompt_key!r} (data.prompt_key) holds chat messages, "
            "but data.chat_template is never"
        )
    if not messages and not _is_text(prompt):
        raise DataError(
            f"{path}: column {cfg.prompt_key!r} (data.prompt_key) is {prompt}, "
            "expected a string or a list of {role, content} messages"
        )
    if messages:
        extra = [c for c in template_columns if c != column_of(cfg.prompt_key, names)]
        if extra:
            raise DataError(
                f"{path}: data.template {cfg.template!r} reads {extra}, but column {cfg.prompt_key!r} "
                "holds chat messages, which go through the chat template as they are"
            )
    else:
        for column in template_columns:
            if column not in names:
                raise missing(column, "data.template")
    answer_key = answer_key_of(cfg, schema)
    if needs_answer and (answer_key is None or type_at(schema, answer_key) is None):
        wanted = answer_key or " or ".join(DEFAULT_ANSWER_KEYS)
        raise missing(wanted, "data.answer_key", ": the reward needs answers")
    answer = type_at(schema, answer_key) if answer_key else None
    if answer is not None and _is_nested(answer):
        raise DataError(
            f"{path}: column {answer_key!r} (data.answer_key) is {answer}, expected a string or a number"
        )
    source = type_at(schema, cfg.source_key)
    if source is not None and not _is_text(source):
        raise DataError(f"{path}: column {cfg.source_key!r} (data.source_key) is {source}, expected a string")
    return messages


def check_first_row(path: str, cfg: Any, *, messages: bool) -> None:
    """DataError naming `path`'s row 0 when its chat messages are malformed (a file written
    with other roles, e.g. ShareGPT's `human`/`gpt`, fails here before any rank starts; a bad
    message in a later row is a bad row at load time)."""
    import pyarrow.parquet as pq

    if not messages:
        return
    parquet = pq.ParquetFile(path)
    if parquet.metadata.num_rows == 0:
        return
    column = column_of(cfg.prompt_key, list(parquet.schema_arrow.names))
    record = parquet.read_row_group(0, columns=[column]).slice(0, 1).to_pylist()[0]
    value = value_at(record, cfg.prompt_key)
    if value is None:  # a null prompt is one bad row, not a layout
        return
    try:
        messages_of(value)
    except ValueError as err:
        raise DataError(f"{path}:0: column {cfg.prompt_key!r} (data.prompt_key): {err}") from None
