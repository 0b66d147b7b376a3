"""A rollout's tools: `build_tool` builds one by name, a built-in (`calculator`, `python`) or user
code ``"package.module:Class"``; `ToolBox` holds a rollout's tools and calls them by name.

Importing this module registers the built-ins (each registers itself in `rl3d.tools.base`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from rl3d.tools.base import BUILTIN_TOOLS, Tool, ToolResult, check_arguments
from rl3d.tools.calculator import Calculator  # noqa: F401  registers "calculator"
from rl3d.tools.python_sandbox import PythonSandbox  # noqa: F401  registers "python"
from rl3d.utils.imports import import_object, is_import_path, suggest

logger = logging.getLogger(__name__)


def build_tool(spec: str, **kwargs: Any) -> Tool:
    """The tool named `spec` (a registered name or ``"package.module:Class"``), built with
    `kwargs`. A path may also name a ready `Tool` instance (then `kwargs` must be empty)."""
    if is_import_path(spec):
        obj = import_object(spec, what="tool", require_callable=False)
    else:
        try:
            obj = BUILTIN_TOOLS.get(spec)
        except ValueError as err:
            raise ValueError(f"tool {spec!r}: {err}") from None
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
