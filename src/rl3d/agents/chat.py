"""Chat messages as prompt token ids: the model's chat template, or a plain format.

A tokenizer with a chat template (HF's `apply_chat_template`) renders the messages, the `tools`
and the generation prompt. A template that does not render `tool_calls` (SmolLM2's) gets the
calls written into the assistant's content in the tool format. A tokenizer without a template
(`rl3d.data.tool_task.ToolTokenizer`) uses the plain format: system and user text as written,
assistant text with its calls as ``<tool_call>{...}</tool_call>``, tool results between the
observation tags, nothing else; so the tool task's agent prompts are the built-in loop's tokens.

`continuation` is how a later turn stays token-exact: when the request's messages are an
earlier request's messages plus the reply the endpoint gave, the new prompt is that request's
prompt and generated ids as they were, then only the tokens of the text the template adds
after the reply. Text the model generated is never tokenized again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl3d.agents.tool_calls import QWEN_TAGS, call_arguments, render_tool_calls


def _text(content: Any) -> str:
    """OpenAI content (a string, None, or a list of text parts) as a string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


class ChatFormat:
    """Renders and tokenizes messages for one tokenizer; `tool_format` as in `rl3d.agents.tool_calls`."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_format: str = "auto",
        observation_tags: tuple[str, str] = ("<result>", "</result>"),
    ):
        self.tokenizer, self.tool_format, self.observation_tags = tokenizer, tool_format, observation_tags
        template = getattr(tokenizer, "chat_template", None)
        self.templated = bool(template) and hasattr(tokenizer, "apply_chat_template")
        self.template_renders_calls = self.templated and "tool_calls" in str(template)
        self._close_ids: tuple[int, ...] | None = None

    def call_close_ids(self) -> tuple[int, ...]:
        """Every token whose text holds a call's close tag: a reply that offers tools stops
        there (one scan of the vocabulary, kept)."""
        if self._close_ids is None:
            tag = QWEN_TAGS[1]
            self._close_ids = tuple(i for i in range(len(self.tokenizer)) if tag in self.decode([i]))
        return self._close_ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # -- rendering ---------------------------------------------------------------------------------
    def _template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = {"role": message["role"], "content": _text(message.get("content"))}
        calls = message.get("tool_calls") or []
        if calls and self.template_renders_calls:
            out["tool_calls"] = [
                {**c, "function": {**c.get("function", {}), "arguments": call_arguments(c)}} for c in calls
            ]
        elif calls:
            rendered = render_tool_calls(calls, "llama3" if self.tool_format == "llama3" else "qwen")
            out["content"] = "\n".join(t for t in (out["content"], rendered) if t)
        for key in ("name", "tool_call_id"):
            if key in message:
                out[key] = message[key]
        return out

    def _plain(self, messages: Sequence[dict[str, Any]]) -> str:
        parts = []
        for message in messages:
            content = _text(message.get("content"))
            if message["role"] == "assistant":
                calls = message.get("tool_calls") or []
                parts.append(content + render_tool_calls(calls, "qwen", newlines=False))
            elif message["role"] == "tool":
                parts.append(self.observation_tags[0] + content + self.observation_tags[1])
            else:
                parts.append(content)
        return "".join(parts)

    def render(
        self, messages: Sequence[dict[str, Any]], tools: list | None, *, add_generation_prompt: bool
    ) -> str:
        if not self.templated:
            return self._plain(messages)
        return self.tokenizer.apply_chat_template(
            [self._template_message(m) for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list | None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    # -- later turns -----------------------------------------------------------------------------
    def continuation(
        self,
        earlier: Sequence[dict[str, Any]],
        reply: dict[str, Any],
        messages: Sequence[dict[str, Any]],
        tools: list | None,
        response_ids: Sequence[int],
        stopped: bool,
    ) -> list[int] | None:
        """The ids that follow an earlier turn's prompt + `response_ids` (the generated reply
        `reply` to `earlier`) to make the prompt of `messages`; None when the template's text
        does not extend that way (the caller then renders `messages` whole)."""
        base = self.render(earlier, tools, add_generation_prompt=True)
        closed = self.render([*earlier, reply], tools, add_generation_prompt=False)
        full = self.render(messages, tools, add_generation_prompt=True)
        if not (closed.startswith(base) and full.startswith(closed)):
            return None
        said, generated = closed[len(base) :], self.decode(response_ids)
        if said.startswith(generated):  # the template writes the reply as generated, then its end
            tail = said[len(generated) :]
        elif stopped and (end := self.decode(response_ids[-1:])) and end in said:
            tail = said[said.rfind(end) + len(end) :]  # written otherwise: what follows the end token
        elif stopped and said.startswith(body := self.decode(response_ids[:-1])):
            tail = said[len(body) :]  # an end token the template does not write: its own ending follows
        else:
            return None
        return self.encode(tail + full[len(closed) :])
