"""What a tool is, how tools are named, and how a parsed call reaches one without raising.

A tool has a `name`, a JSON schema of its arguments (`parameters`, the subset that chat
templates render: an object with typed `properties` and `required`), and `call(arguments)`
returning a `ToolResult`. Tools are named in a recipe either by a registered name
(``calculator``, ``python``) or by import path ``"package.module:Class"`` (never `eval`).

`ToolBox.call` (`rl3d.tools.toolbox`) is the one entry point of a rollout: an unknown tool,
arguments that do not match the schema, and an exception inside the tool all come back as a
`ToolResult` with `error` set, so the caller counts them and a bad call never crashes a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rl3d.utils.imports import suggest
from rl3d.utils.registry import Registry


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

    def preflight(self) -> str | None:
        """Why this tool cannot run on this machine (None: it can). `rl3d validate --preflight`
        and `rl3d train` refuse a recipe naming it; a tool that needs nothing keeps this."""
        return None

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function description that chat templates render."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


BUILTIN_TOOLS: Registry[type[Tool]] = Registry("tool")


def register_tool(cls: type[Tool]) -> type[Tool]:
    """Class decorator: make `cls` buildable by its `name` (`rl3d.tools.build.build_tool`)."""
    BUILTIN_TOOLS.register(cls.name, cls)
    return cls


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
