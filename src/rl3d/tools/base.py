"""What a tool is, how tools are named, and how a parsed call reaches one without raising.

A tool has a `name`, a JSON schema of its arguments (`parameters`, the subset that chat
templates render: an object with typed `properties` and `required`), and `call(arguments)`
returning a `ToolResult`. Tools are named in a recipe either by a registered name
(``calculator``, ``python``) or by import path ``"package.module:Class"`` (never `eval`).

`ToolBox.call` is the one entry point of a rollout: an unknown tool, arguments that do not match
the schema, and an exception inside the tool all come back as a `ToolResult` with `error` set, so
the caller counts them and a bad call never crashes a step.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rl3d.utils.imports import import_object, is_import_path, suggest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gives back. `text` becomes the observation; `error` (set on any failure)
    and `timed_out` are what the metrics count."""

    text: str
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text the policy reads: the output, or the error after it."""
        if self.error is None:
            return self.text
        return f"{self.text}\n[error] {self.error}" if self.text else f"[error] {self.error}"


class Tool(ABC):
    """A tool the policy may call. Subclasses set `name`, `description` and `parameters`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    @abstractmethod
    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run on arguments already checked against `parameters`."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function description that chat templates render."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


BUILTIN_TOOLS: dict[str, type[Tool]] = {}


def register_tool(cls: type[Tool]) -> type[Tool]:
    """Class decorator: make `cls` buildable by its `name`."""
    assert cls.name not in BUILTIN_TOOLS, f"tool {cls.name!r} registered twice"
    BUILTIN_TOOLS[cls.name] = cls
    return cls


def build_tool(spec: str, **kwargs: Any) -> Tool:
    """The tool named `spec` (a registered name or ``"package.module:Class"``), built with
    `kwargs`. A path may also name a ready `Tool` instance (then `kwargs` must be empty)."""
    _load_builtins()
    if is_import_path(spec):
        obj = import_object(spec, what="tool", require_callable=False)
    elif spec in BUILTIN_TOOLS:
        obj = BUILTIN_TOOLS[spec]
    else:
        raise ValueError(
            f"tool {spec!r}: unknown{suggest(spec, BUILTIN_TOOLS)}; known: {sorted(BUILTIN_TOOLS)}"
        )
    if isinstance(obj, Tool):
        if kwargs:
            raise ValueError(f"tool {spec!r} is an instance; it takes no options, got {sorted(kwargs)}")
        return obj
    if not (isinstance(obj, type) and issubclass(obj, Tool)):
        raise ValueError(f"tool {spec!r}: {type(obj).__name__} is not a rl3d.tools.Tool subclass or instance")
    try:
        tool = obj(**kwargs)
    except TypeError as err:
        raise ValueError(f"tool {spec!r}: bad options {sorted(kwargs)}: {err}") from err
    if not isinstance(getattr(tool, "name", None), str) or not tool.name:
        raise ValueError(f"tool {spec!r}: has no name")
    return tool


def _load_builtins() -> None:
    # The built-ins register themselves on import; imported here so that `base` stays light.
    from rl3d.tools import calculator, python_sandbox  # noqa: F401


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def check_arguments(arguments: Any, parameters: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit the schema `parameters` (top-level types, required keys, no
    unknown keys unless ``additionalProperties`` allows them), or None when they fit."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = parameters.get("properties", {})
    missing = [key for key in parameters.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if key not in properties:
            if parameters.get("additionalProperties", False) is False:
                return f"unknown argument {key!r}{suggest(key, properties)}; expected {sorted(properties)}"
            continue
        expected = properties[key].get("type")
        if expected is None:
            continue
        names = [expected] if isinstance(expected, str) else list(expected)
        types = tuple(t for name in names for t in _JSON_TYPES.get(name, (object,)))
        # JSON has no bool/int distinction problem, Python does: True is an int.
        is_bool_as_number = isinstance(value, bool) and "boolean" not in names
        if not isinstance(value, types) or is_bool_as_number:
            return f"argument {key!r} must be {' or '.join(names)}, got {type(value).__name__}"
    return None


class ToolBox:
    """The tools of one rollout, by name. `call` never raises for bad input."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"tools: two tools named {tool.name!r}")
            self.tools[tool.name] = tool

    @classmethod
    def from_specs(cls, specs: Mapping[str, Mapping[str, Any]] | Iterable[str]) -> ToolBox:
        """From ``{spec: options}`` (or a list of specs without options), as a recipe writes it."""
        items = specs.items() if isinstance(specs, Mapping) else ((spec, {}) for spec in specs)
        return cls(build_tool(spec, **dict(options or {})) for spec, options in items)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def call(self, name: Any, arguments: Any) -> ToolResult:
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return ToolResult(
                "",
                error=f"unknown tool {name!r}{suggest(str(name), self.tools)}; known: {sorted(self.tools)}",
            )
        problem = check_arguments(arguments, tool.parameters)
        if problem is not None:
            return ToolResult("", error=f"tool {name!r}: {problem}")
        try:
            return tool.call(arguments)
        except Exception as err:  # a tool's bug is an error observation, never a crashed step
            logger.warning("tool %r raised %r", name, err)
            return ToolResult("", error=f"tool {name!r} failed: {type(err).__name__}: {err}")
