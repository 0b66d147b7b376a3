"""What the endpoint answers, without HTTP: OpenAI chat and text completions over a batching
queue in front of the rollout engine, every completion recorded by session.

A reply ends at the model's end ids, at a `stop` string (single-token strings stop the engine;
longer ones cut the reply after generation, keeping the generated tokens up to the one that
completes the string) or, when the request offers tools, after a token holding the call's
close tag (as the tool loop stops). The reply's text without the end token is parsed
for tool calls (`rl3d.agents.tool_calls`). Log-probs are the engine's raw (temperature 1)
ones: what the trainer recomputes and what is recorded.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rl3d.agents.batcher import GenerateBatcher, Sample
from rl3d.agents.chat import ChatFormat
from rl3d.agents.protocol import RequestError, Sampling, read_messages, read_sampling, read_tools
from rl3d.agents.sessions import Completion, SessionLog
from rl3d.agents.tool_calls import ParsedReply, parse_tool_calls
from rl3d.rollout.base import FINISH_STOP, SamplingParams, check_prompts


class AgentEndpoint:
    """Answers OpenAI request bodies; `defaults` are the rollout's sampling settings (their
    `max_new_tokens` bounds `max_tokens`), `model_name` what `GET /v1/models` lists (any name a
    request gives is served by the same policy)."""

    def __init__(
        self,
        batcher: GenerateBatcher,
        chat: ChatFormat,
        defaults: SamplingParams,
        *,
        vocab_size: int,
        model_name: str = "rl3d-policy",
        request_timeout_s: float = 600.0,
        parallel_tool_calls: bool = False,
    ):
        self.batcher, self.chat, self.defaults, self.vocab_size = batcher, chat, defaults, vocab_size
        self.model_name, self.request_timeout_s = model_name, request_timeout_s
        # a reply that offers tools may make several calls (else it stops at the first close tag);
        # a request's `parallel_tool_calls` overrides
        self.parallel_tool_calls = parallel_tool_calls
        self.sessions = SessionLog()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rl3d"}],
        }

    # -- generation --------------------------------------------------------------------------------
    def _generate(
        self, session: str, prompt_ids: list[int], sampling: Sampling, tool_stops: bool
    ) -> tuple[list[Sample], frozenset[int]]:
        """The request's samples, and its end ids (left out of the reply's text)."""
        if self.sessions.is_closed(session):
            raise RequestError(
                f"session {session!r} is over (its agent ran past its time)", code="session_closed"
            )
        try:
            check_prompts([prompt_ids], self.vocab_size)
        except ValueError as err:
            raise RequestError(str(err), param="prompt") from None
        ends = list(sampling.params.stop_token_ids)
        for text in sampling.stop:  # a stop string that is one token stops the engine itself
            ids = self.chat.encode(text)
            if len(ids) == 1 and self.chat.decode(ids) == text:
                ends.append(ids[0])
        stops = ends + list(self.chat.call_close_ids() if tool_stops else ())
        params = dataclasses.replace(sampling.params, stop_token_ids=tuple(dict.fromkeys(stops)))
        try:
            samples = self.batcher.submit(prompt_ids, params).result(timeout=self.request_timeout_s)
        except FutureTimeout:
            raise RequestError("generation timed out", status=503, code="timeout") from None
        except Exception as err:
            raise RequestError(f"generation failed: {err}", status=500) from err
        return samples, frozenset(ends)

    def _finish(self, sample: Sample, sampling: Sampling, ends: frozenset[int]) -> tuple[Sample, str]:
        """The sample as kept (cut after a stop string) and the reply text; an end token is kept
        in the ids but not in the text."""
        ids, lps, finish = list(sample.response_ids), list(sample.raw_logprobs), sample.finish_reason
        body = ids[:-1] if finish == FINISH_STOP and ids and ids[-1] in ends else ids
        text = self.chat.decode(body)
        hits = [(text.find(s), s) for s in sampling.stop if s in text]
        if hits:
            at, s = min(hits)
            k = next(k for k in range(1, len(body) + 1) if s in self.chat.decode(body[:k]))
            ids, lps, text, finish = ids[:k], lps[:k], text[:at], FINISH_STOP
        top = sample.top[: len(ids)] if sample.top is not None else None
        return Sample(ids, sample.logprobs[: len(ids)], lps, finish, top), text

    # -- the two completion kinds ------------------------------------------------------------------
    def chat_completion(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        messages = read_messages(body)
        tools, parse_calls = read_tools(body)
        parallel = body.get("parallel_tool_calls", self.parallel_tool_calls)
        if not isinstance(parallel, bool):
            raise RequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
        sampling = read_sampling(body, self.defaults, chat=True)
        prompt_ids = self._chat_prompt(session, messages, tools)
        samples, ends = self._generate(session, prompt_ids, sampling, parse_calls and not parallel)
        choices, generated = [], 0
        for i, sample in enumerate(samples):
            kept, text = self._finish(sample, sampling, ends)
            ids, lps, finish = kept.response_ids, kept.raw_logprobs, kept.finish_reason
            parsed = parse_tool_calls(text, self.chat.tool_format) if parse_calls else ParsedReply(text)
            reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                reply["tool_calls"] = parsed.tool_calls
            self.sessions.add(session, Completion(prompt_ids, ids, lps, finish, messages, tools, reply))
            generated += len(ids)
            choice = {
                "index": i,
                "message": reply,
                "finish_reason": "tool_calls" if parsed.tool_calls else finish,
                "logprobs": {"content": self._token_logprobs(kept)} if sampling.logprobs else None,
            }
            choices.append(choice)
        return self._response("chat.completion", "chatcmpl", body, choices, len(prompt_ids), generated)

    def _chat_prompt(self, session: str, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """A later turn of the session extends its earlier turn's ids (`ChatFormat.continuation`);
        anything else is rendered whole."""
        earlier = self.sessions.earlier_turn(session, messages, tools)
        if earlier is not None:
            stopped = earlier.finish_reason == FINISH_STOP
            more = self.chat.continuation(
                earlier.messages, earlier.reply, messages, tools, earlier.response_ids, stopped
            )
            if more is not None:
                return earlier.prompt_ids + earlier.response_ids + more
        try:
            return self.chat.prompt_ids(messages, tools)
        except Exception as err:  # a template that rejects the conversation (roles out of order)
            raise RequestError(
                f"the chat template failed on these messages: {err}", param="messages"
            ) from None

    def completion(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        sampling = read_sampling(body, self.defaults, chat=False)
        prompts = self._text_prompts(body)
        choices, generated = [], 0
        for prompt_ids in prompts:
            samples, ends = self._generate(session, prompt_ids, sampling, False)
            for sample in samples:
                kept, text = self._finish(sample, sampling, ends)
                ids, lps, finish = kept.response_ids, kept.raw_logprobs, kept.finish_reason
                self.sessions.add(session, Completion(prompt_ids, ids, lps, finish))
                generated += len(ids)
                logprobs = None
                if sampling.logprobs:
                    tokens = [self.chat.decode([t]) for t in ids]
                    logprobs = {
                        "tokens": tokens,
                        "token_logprobs": lps,
                        "top_logprobs": [{self.chat.decode([t]): lp for t, lp in alts} for alts in kept.top]
                        if kept.top is not None
                        else None,
                        "text_offset": None,
                    }
                choices.append(
                    {"index": len(choices), "text": text, "finish_reason": finish, "logprobs": logprobs}
                )
        return self._response("text_completion", "cmpl", body, choices, sum(map(len, prompts)), generated)

    def _text_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        add = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str):
            return [self.chat.encode(prompt, add_special_tokens=add)]
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [q for p in prompt for q in self._text_prompts({"prompt": p, "add_special_tokens": add})]
        raise RequestError("prompt must be a string, a list of token ids, or a list of those", param="prompt")

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.chat.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _token_logprobs(self, sample: Sample) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content`: each generated token, its raw log-prob, and (when asked)
        its most likely alternatives, most likely first."""
        tops = sample.top or [[] for _ in sample.response_ids]
        return [
            self._token_entry(t, lp) | {"top_logprobs": [self._token_entry(a, alp) for a, alp in alts]}
            for t, lp, alts in zip(sample.response_ids, sample.raw_logprobs, tops)
        ]

    def _response(
        self, kind: str, prefix: str, body: dict, choices: list, prompt_tokens: int, generated: int
    ):
        return {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": kind,
            "created": int(time.time()),
            "model": str(body.get("model") or self.model_name),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
            },
        }
