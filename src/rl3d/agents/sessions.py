"""Token-exact trajectories: every completion the endpoint served, by session, and the training
sequences they make.

A completion records the prompt ids the engine saw, the response ids it generated and its raw
(temperature-1) log-probs. `training_sequences` chains a session's completions: one whose
prompt starts with an earlier sequence's tokens extends that sequence (the new prompt tokens,
tool results and template text, go in with mask 0; the generated tokens with mask 1); any other
completion starts a sequence of its own. Every id comes from the engine or from the prompt the
engine was given; nothing is re-tokenized.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from rl3d.agents.tool_calls import call_arguments


@dataclass(frozen=True)
class Completion:
    """One generated response, and (chat requests) the messages and tools it answered and the
    assistant message it was returned as (`continuation` matches the next turn against them)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    messages: list[dict[str, Any]] | None = None
    tools: list | None = None
    reply: dict[str, Any] | None = None


@dataclass
class TrainingSequence:
    """`ids` = the first prompt, then every later token; `mask` 1 at generated tokens; `logprobs`
    the engine's at generated tokens, 0 elsewhere. `prompt_length` tokens of `ids` are the first
    prompt."""

    prompt_length: int
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    num_completions: int = 1
    finish_reason: str = "stop"
    completions: list[int] = field(default_factory=list)  # which of the session's, in order


def training_sequences(completions: list[Completion]) -> list[TrainingSequence]:
    sequences: list[TrainingSequence] = []
    for i, c in enumerate(completions):
        seq = next(
            (
                s
                for s in reversed(sequences)
                if len(c.prompt_ids) >= len(s.ids) and c.prompt_ids[: len(s.ids)] == s.ids
            ),
            None,
        )
        if seq is None:
            n = len(c.prompt_ids)
            seq = TrainingSequence(n, list(c.prompt_ids), [0] * n, [0.0] * n, num_completions=0)
            sequences.append(seq)
        else:
            added = c.prompt_ids[len(seq.ids) :]
            seq.ids += added
            seq.mask += [0] * len(added)
            seq.logprobs += [0.0] * len(added)
        seq.ids += c.response_ids
        seq.mask += [1] * len(c.response_ids)
        seq.logprobs += c.logprobs
        seq.num_completions += 1
        seq.completions.append(i)
        seq.finish_reason = c.finish_reason
    return sequences


def _same_reply(sent: dict[str, Any], given: dict[str, Any]) -> bool:
    """Whether the assistant message an agent sends back is the reply it was given (agents drop
    or add empty fields, and may re-serialize the arguments)."""
    if sent.get("role") != "assistant" or (sent.get("content") or None) != (given.get("content") or None):
        return False
    calls = [(c.get("function", {}).get("name"), call_arguments(c)) for c in sent.get("tool_calls") or []]
    return calls == [(c["function"]["name"], call_arguments(c)) for c in given.get("tool_calls") or []]


@dataclass
class SessionLog:
    """Completions by session id (thread-safe). A closed session takes no more completions: an
    agent past its time can no longer add to the rollout."""

    completions: dict[str, list[Completion]] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def is_closed(self, session: str) -> bool:
        with self.lock:
            return session in self.closed

    def add(self, session: str, completion: Completion) -> bool:
        with self.lock:
            if session in self.closed:
                return False
            self.completions.setdefault(session, []).append(completion)
            return True

    def close(self, session: str) -> list[Completion]:
        with self.lock:
            self.closed.add(session)
            return list(self.completions.get(session, []))

    def earlier_turn(
        self, session: str, messages: list[dict[str, Any]], tools: list | None
    ) -> Completion | None:
        """The newest completion of `session` whose messages and reply begin `messages`."""
        with self.lock:
            done = list(self.completions.get(session, []))
        for c in reversed(done):
            k = len(c.messages or ())
            if (
                c.messages is not None
                and c.reply is not None
                and c.tools == tools
                and len(messages) > k
                and messages[:k] == c.messages
                and _same_reply(messages[k], c.reply)
            ):
                return c
        return None
