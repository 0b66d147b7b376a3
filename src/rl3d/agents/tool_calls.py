"""The model's tool-call text as OpenAI `tool_calls`, and calls back as text, per chat format.

- ``qwen`` (Hermes, what Qwen2.5's template teaches): one block per call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3`` (Llama 3.1-3.3's JSON tool calling): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}`` or a JSON list of them (several calls), optionally
  after ``<|python_tag|>``;
- ``auto``: ``qwen`` when the text holds its open tag, else ``llama3``.

`parse_tool_calls` never raises: a call that cannot be read (bad JSON, no name, arguments not an
object) leaves the whole text as content with no calls, so the agent sees what the model wrote
instead of an HTTP error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from rl3d.tools import ToolCall, ToolCallParser

TOOL_FORMATS = ("auto", "qwen", "llama3")
QWEN_TAGS = ("<tool_call>", "</tool_call>")
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedReply:
    """An assistant reply: its text without the calls (None when nothing else) and the calls as
    OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": "<json>"}}``."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _qwen_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    """Every tagged call and the text between them; None when one is malformed."""
    parser = ToolCallParser(open_tag=QWEN_TAGS[0], close_tag=QWEN_TAGS[1])
    calls, rest, pos = [], [], 0
    while True:
        found = parser.parse(text[pos:])
        if found is None:
            rest.append(text[pos:])
            break
        if not isinstance(found, ToolCall):
            return None
        rest.append(text[pos : pos + found.start])
        calls.append(found)
        pos += found.end
    return "".join(rest).strip(), calls


def _llama3_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The message as one call object, or a JSON list of them; None when any is malformed."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    calls = [_llama3_object(o) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(c is not None for c in calls) else None


def parse_tool_calls(text: str, fmt: str = "auto") -> ParsedReply:
    """`text` (a generated reply, end token removed) as content and tool calls in format `fmt`."""
    assert fmt in TOOL_FORMATS, fmt
    content = text if text.strip() else None
    if fmt == "qwen" or (fmt == "auto" and QWEN_TAGS[0] in text):
        found = _qwen_calls(text)
        if found is None or not found[1]:
            return ParsedReply(content)
        rest, calls = found
        return ParsedReply(rest or None, [openai_call(c.name, c.arguments) for c in calls])
    calls = _llama3_calls(text)
    if calls is None:
        return ParsedReply(content)
    return ParsedReply(None, [openai_call(c.name, c.arguments) for c in calls])


def call_arguments(call: dict[str, Any]) -> dict[str, Any] | str:
    """An OpenAI tool call's arguments as an object (a template renders it), or the raw string
    when it is not a JSON object."""
    arguments = call.get("function", {}).get("arguments", "{}")
    if isinstance(arguments, dict):
        return arguments
    try:
        obj = json.loads(arguments) if str(arguments).strip() else {}
    except (json.JSONDecodeError, RecursionError, TypeError):
        return arguments
    return obj if isinstance(obj, dict) else arguments


def render_tool_calls(calls: list[dict[str, Any]], fmt: str, *, newlines: bool = True) -> str:
    """OpenAI tool calls as the text the model writes in format `fmt` (for chat templates that
    do not render `tool_calls` themselves)."""
    if fmt == "llama3":  # one object, or a list of them for several calls
        objects = [
            {"name": c.get("function", {}).get("name", ""), "parameters": call_arguments(c)} for c in calls
        ]
        return json.dumps(objects[0] if len(objects) == 1 else objects) if objects else ""
    parts = []
    for call in calls:
        name = call.get("function", {}).get("name", "")
        body = json.dumps({"name": name, "arguments": call_arguments(call)})
        sep = "\n" if newlines else ""
        parts.append(f"{QWEN_TAGS[0]}{sep}{body}{sep}{QWEN_TAGS[1]}")
    return ("\n" if newlines else "").join(parts)
