"""Find a tool call in generated text: a JSON object between two tags.

The default tags are Hermes/Qwen's ``<tool_call>`` / ``</tool_call>``; a recipe or chat template
may set others. The object is ``{"name": ..., "arguments": {...}}``; ``arguments`` may also be a
JSON string holding the object (OpenAI's wire form). `ToolCallParser.parse` never raises: text
without the opening tag is no call (None), anything else malformed is a `ToolCallError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    start: int = 0  # character span of the whole tagged call in the text
    end: int = 0


@dataclass(frozen=True)
class ToolCallError:
    """A call that was attempted but could not be read; `message` is shown to the policy."""

    message: str
    start: int = 0
    end: int = 0


@dataclass(frozen=True, kw_only=True)
class ToolCallParser:
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def __post_init__(self) -> None:
        if not self.open_tag or not self.close_tag:
            raise ValueError("tools.parser: open_tag and close_tag must be non-empty")
        if self.open_tag == self.close_tag:
            raise ValueError(f"tools.parser: open_tag and close_tag are both {self.open_tag!r}")

    def parse(self, text: str) -> ToolCall | ToolCallError | None:
        """The first call in `text`, an error for a malformed one, or None when there is none."""
        start = text.find(self.open_tag)
        if start < 0:
            return None
        body_start = start + len(self.open_tag)
        close = text.find(self.close_tag, body_start)
        if close < 0:
            return ToolCallError(f"tool call has no closing {self.close_tag!r}", start, len(text))
        end = close + len(self.close_tag)
        body = text[body_start:close].strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as err:
            return ToolCallError(f"tool call is not valid JSON: {err}", start, end)
        if not isinstance(obj, dict):
            return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", start, end)
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCallError('tool call needs a string "name"', start, end)
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError) as err:
                return ToolCallError(f'tool call "arguments" string is not valid JSON: {err}', start, end)
        if not isinstance(arguments, dict):
            return ToolCallError(
                f'tool call "arguments" must be an object, got {type(arguments).__name__}', start, end
            )
        return ToolCall(name, arguments, start, end)
