"""OpenAI's request fields read and checked; errors in OpenAI's JSON shape.

Every problem with a request is a `RequestError` naming the field (`param`), which the server
sends as ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status, so a client
raises its usual `BadRequestError` and the rollout goes on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rl3d.rollout.base import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOPS = 4


class RequestError(Exception):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, lo: float, hi: float, default: float, *, open_lo: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key} must be a number, got {value!r}", param=key)
    if value > hi or value < lo or (open_lo and value == lo):
        raise RequestError(f"{key} must be in {'(' if open_lo else '['}{lo}, {hi}], got {value}", param=key)
    return float(value)


def _integer(body: dict, key: str, lo: int, hi: int | None, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{key} must be an integer {bound}, got {value!r}", param=key)
    return value


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=where)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(
            f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
        )
    arguments = fn.get("arguments", "{}")
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {
            "name": fn["name"],
            "arguments": arguments if isinstance(arguments, str) else str(arguments),
        },
    }


def read_messages(body: dict) -> list[dict[str, Any]]:
    """`messages` with the fields a chat template reads (agents send extra ones, e.g. `refusal`)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {list(ROLES)}", param=where)
        msg: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"{where}.tool_calls must be a list", param=where)
            msg["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])
            ]
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def read_tools(body: dict) -> tuple[list | None, bool]:
    """(`tools`, whether a call may be parsed from the reply: tools given and tool_choice not "none")."""
    tools = body.get("tools")
    if tools is None:
        return None, False
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise RequestError(
            "tools must be a list of {'type': 'function', 'function': {'name', ...}}", param="tools"
        )
    choice = body.get("tool_choice", "auto")
    if choice not in ("none", "auto", "required") and not (isinstance(choice, dict) and "function" in choice):
        raise RequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'function': ...}", param="tool_choice"
        )
    return (tools or None), bool(tools) and choice != "none"


@dataclass(frozen=True)
class Sampling:
    """A request's sampling as the engine's params, plus what the endpoint does around them."""

    params: SamplingParams  # top_logprobs: how many alternatives per token the reply lists
    stop: tuple[str, ...]
    logprobs: bool


def read_sampling(body: dict, defaults: SamplingParams, *, chat: bool) -> Sampling:
    """`temperature`, `top_p`, `max_tokens` (clamped to the rollout's `max_new_tokens`), `n`,
    `stop`, `seed`, `logprobs` and `top_logprobs` (the legacy completions' `logprobs: k`);
    defaults are the rollout's."""
    if not isinstance(body.get("stream", False), bool):
        raise RequestError("stream must be a boolean", param="stream")
    if body.get("echo"):
        raise RequestError("echo is not supported by the rollout endpoint", param="echo")
    temperature = _number(body, "temperature", 0.0, 2.0, defaults.temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, defaults.top_p, open_lo=True)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = min(_integer(body, key, 1, None, defaults.max_new_tokens), defaults.max_new_tokens)
    n = _integer(body, "n", 1, MAX_N, 1)
    seed = _integer(body, "seed", 0, None, None)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings", param="stop"
        )
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise RequestError("logprobs must be a boolean", param="logprobs")
        top = _integer(body, "top_logprobs", 0, 20, 0)
    else:
        top = _integer(body, "logprobs", 0, 5, None)
        logprobs = top is not None
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    params = dataclasses.replace(
        defaults, temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, n=n, seed=seed,
        top_logprobs=top or 0,
    )  # fmt: skip
    return Sampling(params, tuple(stop), logprobs)


def stream_events(response: dict[str, Any], *, usage: bool) -> list[dict[str, Any]]:
    """A finished response as the server-sent events of a streamed one: every choice's whole
    reply in one chunk, then its finish reason (and the usage, when asked)."""
    chat = response["object"] == "chat.completion"
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for choice in response["choices"]:
        if not chat:
            events.append(head | {"choices": [choice]})
            continue
        message, index = choice["message"], choice["index"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
        part = {"index": index, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        end = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}
        events += [head | {"choices": [part]}, head | {"choices": [end]}]
    if usage:
        events.append(head | {"choices": [], "usage": response["usage"]})
    return events
