"""Turn a plain dict into typed, frozen component configs, strictly.

Each error names the dotted key and the file that set it (provenance comes from the loader).
Supported field types: bool, int, float (ints accepted), str, Literal[...], Optional[T],
list[T], dict[str, T], Any and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from rl3d.config.errors import ConfigError, FieldError
from rl3d.utils.imports import suggest

T = TypeVar("T")
SourceOf = Callable[[str], "str | None"]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _fail(msg: str, key: str, source_of: SourceOf) -> ConfigError:
    return ConfigError(msg, key=key, source=source_of(key))


def _convert(value: Any, tp: Any, key: str, source_of: SourceOf) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for candidate in inner:
            try:
                return _convert(value, candidate, key, source_of)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        raise _fail(f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}", key, source_of)
    if origin is Literal:
        if value not in args:
            hint = suggest(str(value), [str(a) for a in args])
            raise _fail(f"expected {_type_name(tp)}, got {value!r}{hint}", key, source_of)
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _fail(f"expected a list, got {type(value).__name__} {value!r}", key, source_of)
        return [_convert(v, args[0], f"{key}[{i}]", source_of) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _fail(f"expected a mapping, got {type(value).__name__}", key, source_of)
        return {str(k): _convert(v, args[1], f"{key}.{k}", source_of) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise _fail(f"expected a mapping (section {tp.__name__}), got {value!r}", key, source_of)
        return from_dict(tp, value, prefix=key, source_of=source_of)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(f"expected true or false, got {value!r}", key, source_of)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"expected an integer, got {value!r}", key, source_of)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(f"expected a number, got {value!r}", key, source_of)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(f"expected a string, got {type(value).__name__} {value!r}", key, source_of)
        return value
    raise AssertionError(f"unsupported config field type {tp!r} at {key}")


def yaml_key(field_name: str) -> str:
    """A field named after a Python keyword plus "_" (`async_`) is spelled without it in YAML."""
    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "", source_of: SourceOf) -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and missing required ones."""
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f.name): f for f in dataclasses.fields(cls)}  # by YAML key
    dotted = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    for name in data:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f" (did you mean {dotted(close[0])!r}?)" if close else ""
            raise _fail(f"unknown key{hint}; known keys here: {', '.join(fields)}", dotted(name), source_of)
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[field.name] = _convert(data[name], hints[field.name], dotted(name), source_of)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError("missing required key", key=dotted(name), source=source_of(prefix) or None)
    try:
        return cls(**kwargs)
    except FieldError as err:  # a component's own __post_init__ check
        key = dotted(err.field)
        raise ConfigError(str(err).split(": ", 1)[1], key=key, source=source_of(key)) from None


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config (for writing the resolved YAML)."""
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f.name): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
