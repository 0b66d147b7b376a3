"""Tools the policy calls during multi-turn rollouts: the interface and registry
(`base`), the tool-call parser (`parser`), and the built-ins `calculator` and `python`
(a sandbox the kernel confines, `python_sandbox`). Imports only `rl3d.utils`."""

from rl3d.tools.base import (
    BUILTIN_TOOLS,
    Tool,
    ToolResult,
    check_arguments,
    register_tool,
)
from rl3d.tools.parser import ToolCall, ToolCallError, ToolCallParser
from rl3d.tools.toolbox import ToolBox, build_tool

__all__ = [
    "BUILTIN_TOOLS",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "ToolResult",
    "build_tool",
    "check_arguments",
    "register_tool",
]
