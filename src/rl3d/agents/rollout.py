"""`rollout.agent.kind: endpoint`: a user's agent function drives the rollout through the endpoint.

For each sample (a prompt row, `n` times) `run(client, sample)` runs in its own thread with
`client = openai.OpenAI(base_url=<endpoint>, api_key="rl3d")` bound to the sample's session,
and returns its reward, or `(reward, info)`. At most `concurrency` run at once, each given
`timeout_s` of wall clock from its start. An agent that raises, returns something that is not
a finite number, or runs out of time scores 0 and is counted (`agent/errors`, `agent/timeouts`);
the rollout goes on. A session is closed when its agent ends or runs out of time, so a late
request gets an error and adds nothing; the thread of a hung agent is left behind (a daemon:
threads cannot be killed) and the rollout returns at the deadline.

Each session's completions become training sequences (`rl3d.agents.sessions`), each a row
(`rl3d.agents.base.AgentRow`, up to `max_rows_per_session`), all with the session's reward and
its prompt's group.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl3d.agents.base import AgentRow
from rl3d.agents.sessions import Completion, TrainingSequence, training_sequences

logger = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass
class AgentOutcome:
    """What one sample's agent did: its reward (0 on failure), info, and its session's
    completions in order."""

    session: str
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    completions: list[Completion] = field(default_factory=list)

    def sequences(self) -> list[TrainingSequence]:
        return training_sequences(self.completions)

    def rows(self, max_rows: int) -> list[TrainingSequence]:
        """The session's training rows, at most `max_rows`: its longest chain of turns first (the
        last one on a tie), then each other sequence (completions that do not extend it: a side
        question, the other choices of `n > 1`) in the order the agent asked for them."""
        sequences = self.sequences()
        if not sequences:
            return []
        main = max(reversed(sequences), key=lambda s: s.num_completions)  # max keeps the first
        return [main, *(s for s in sequences if s is not main)][:max_rows]


def _as_reward(value: Any) -> tuple[float, dict[str, Any]]:
    info: Any = {}
    if isinstance(value, tuple) and len(value) == 2:
        value, info = value
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(f"returned {value!r}: not a finite number (or a (reward, info) pair)")
    if not isinstance(info, dict):
        raise TypeError(f"returned info {type(info).__name__}: not a dict")
    return float(value), info


class LiveAgents:
    """The samples whose agents are running (thread-safe); `len()` is how many."""

    def __init__(self) -> None:
        self._running: set[int] = set()
        self._lock = threading.Lock()

    def start(self, i: int) -> None:
        with self._lock:
            self._running.add(i)

    def end(self, i: int) -> None:
        with self._lock:
            self._running.discard(i)

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)


def _call(fn: Callable, client: Any, sample: dict[str, Any], box: dict[str, Any], on_end: Callable) -> None:
    try:
        box["reward"], box["info"] = _as_reward(fn(client, sample))
    except Exception as err:
        box["error"] = f"{type(err).__name__}: {err}"
    box["done"] = True
    on_end()


def run_agents(
    fn: Callable,
    samples: list[dict[str, Any]],
    sessions: list[str],
    make_client: Callable[[str], Any],
    close_session: Callable[[str], list[Completion]],
    *,
    concurrency: int,
    timeout_s: float,
    live: LiveAgents | None = None,
) -> list[AgentOutcome]:
    """`fn(client, sample)` per sample in its session; returns when each has ended or run past
    `timeout_s` from its own start. `live` tracks the agents running."""
    live = LiveAgents() if live is None else live
    outcomes = [AgentOutcome(session) for session in sessions]
    waiting = deque(range(len(samples)))
    running: dict[int, tuple[float, dict[str, Any]]] = {}  # sample -> (start, what its agent left)
    ended = threading.Event()  # an agent returned: look now, not at the next poll
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.popleft()
            box: dict[str, Any] = {}
            client = make_client(sessions[i])

            def on_end(i: int = i) -> None:
                live.end(i)
                ended.set()

            thread = threading.Thread(
                target=_call, args=(fn, client, samples[i], box, on_end), name=f"rl3d-agent-{i}", daemon=True
            )
            running[i] = (time.monotonic(), box)
            live.start(i)
            thread.start()
        ended.wait(_POLL_S)
        ended.clear()
        now = time.monotonic()
        for i, (start, box) in list(running.items()):
            out = outcomes[i]
            finished = "done" in box  # set last, before `ended`: is_alive may lag behind
            if not finished and now - start <= timeout_s:
                continue
            del running[i]
            live.end(i)  # a hung agent's too: the endpoint stops waiting for it
            out.seconds = now - start
            out.completions = close_session(out.session)
            if not finished:
                out.timed_out = True
                out.error = f"timed out after {timeout_s:g}s (rollout.agent.timeout_s)"
                logger.warning("agent of session %s timed out after %.1fs: scored 0", out.session, timeout_s)
            elif "error" in box:
                out.error = box["error"]
                logger.warning("agent of session %s failed, scored 0: %s", out.session, out.error)
            else:
                out.reward, out.info = box["reward"], box["info"]
    return outcomes


def _turns(seq: TrainingSequence, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """The chain's turns as the built-in loop records them: each run of generated tokens is a
    turn's `text`, the tokens after it up to the next turn (tool results, template text) its
    `observation` (None after the last)."""
    turns: list[dict[str, Any]] = []
    start = seq.prompt_length
    for k in range(seq.prompt_length, len(seq.ids) + 1):
        end = k == len(seq.ids)
        if end or (k > start and seq.mask[k] != seq.mask[k - 1]):
            part = decode(seq.ids[start:k])
            if seq.mask[start]:
                turns.append({"text": part, "observation": None})
            elif turns:
                turns[-1]["observation"] = part
            start = k
    return turns


def agent_record(
    out: AgentOutcome,
    seq: TrainingSequence | None,
    decode: Callable[[list[int]], str] | None = None,
    *,
    rows: list[TrainingSequence] | None = None,
) -> dict[str, Any]:
    """The trajectory record of one of the session's rows (`seq`, a sequence of its turns;
    `rows`: all the session's rows, default `[seq]`): the agent's reward and what it did
    (`agent`, the same on every row of the session), the row's turns (with `decode`: a reward
    function or hook that reads the built-in loop's turns reads these alike), and the row's
    counts the multi-turn metrics read (`rl3d.tools.trajectory`)."""
    rows = ([seq] if seq else []) if rows is None else rows
    trained = sum(s.num_completions for s in rows)
    mine = [out.completions[i] for i in seq.completions] if seq else []
    calls = sum(len((c.reply or {}).get("tool_calls") or []) for c in mine)
    policy = sum(seq.mask) if seq else 0
    observed = len(seq.ids) - seq.prompt_length - policy if seq else 0
    return {
        "reward": out.reward,
        "agent": {
            "session": out.session,
            "info": out.info,
            "error": out.error,
            "timed_out": out.timed_out,
            "seconds": out.seconds,
            "calls": len(out.completions),
            "turns": rows[0].num_completions if rows else 0,
            "rows": len(rows),
            "unused_completions": len(out.completions) - trained,
        },
        "turns": _turns(seq, decode) if seq and decode else [],
        "num_turns": seq.num_completions if seq else 0,
        "num_calls": calls,
        "num_errors": 0,
        "num_timeouts": 0,
        "num_observation_tokens": observed,
        "num_policy_tokens": policy,
    }


def agent_reward(inp: Any) -> float:
    """The reward function of agent rollouts (`reward.fn: rl3d.agents:agent_reward`): the score
    the agent returned for the row's session."""
    record = getattr(inp, "trajectory", None)
    if not record or "agent" not in record:
        raise ValueError("agent_reward scores rows of agent rollouts only (set rollout.agent.fn)")
    return float(record["reward"])


class EndpointAgent:
    """One rank's agent rollouts on `engine` (`cfg`: `rl3d.config.agent.AgentConfig`): an
    endpoint for the rollout's length, and the user's function run per sample against it."""

    def __init__(self, cfg: Any, engine: Any, tokenizer: Any):
        from rl3d.agents.chat import ChatFormat

        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.fn = cfg.resolve()
        self.chat = ChatFormat(tokenizer, tool_format=cfg.tool_format)

    def rollout(self, prompts: Any, params: Any) -> list[AgentRow]:
        """The user's agent per sample (`params.n` per prompt, each its own session). A session
        gives a row for its longest chain of turns that extend one another, then (up to
        `max_rows_per_session`) one per other sequence of its completions; every row has the
        session's reward and its prompt's group, so a prompt may have more than `n` rows
        (`agent/extra_rows`). A session with no completion gives its prompt alone, nothing in
        the loss."""
        fields = [k for k in prompts.meta if k != "uid"]
        samples = [
            {**{k: prompts[k][p] for k in fields}, "prompt": agent_prompt(prompts, p), "sample_index": j}
            for p in range(len(prompts))
            for j in range(params.n)
        ]
        # ids unique in the step (the session metrics count sessions of every generation rank)
        sessions = [f"{int(prompts['uid'][p])}-{j}" for p in range(len(prompts)) for j in range(params.n)]
        rows = []
        for i, out in enumerate(self.run(samples, params, sessions)):  # prompt-major
            p = i // params.n
            sequences = out.rows(self.cfg.max_rows_per_session)
            if not sequences:
                prompt = [int(t) for t in prompts["prompt_ids"][p]]
                rows.append(
                    AgentRow(p, prompt, [], [], [], "length", agent_record(out, None, self.chat.decode))
                )
            for seq in sequences:
                k = seq.prompt_length
                record = agent_record(out, seq, self.chat.decode, rows=sequences)
                rows.append(
                    AgentRow(
                        p, seq.ids[:k], seq.ids[k:], seq.logprobs[k:], seq.mask[k:], seq.finish_reason, record
                    )
                )
        return rows

    def run(
        self, samples: list[dict[str, Any]], defaults: Any, sessions: list[str] | None = None
    ) -> list[AgentOutcome]:
        """Each sample's outcome in its session (`sessions`: their ids, unique in the step;
        default `sample-<i>`); `defaults` (the rollout's `SamplingParams`) is what a request
        gets for the fields it leaves out."""
        try:
            import httpx
            import openai
        except ImportError as err:
            raise ImportError("rollout.agent needs the openai package: pip install 'rl3d[agents]'") from err
        from rl3d.agents.server import AgentServer

        cfg, live = self.cfg, LiveAgents()
        server = AgentServer(
            self.engine,
            self.tokenizer,
            dataclasses.replace(defaults, n=1),
            chat=self.chat,
            max_batch_rows=cfg.max_batch_rows,
            batch_wait_s=cfg.batch_wait_ms / 1000,
            max_body_bytes=cfg.max_body_bytes,
            parallel_tool_calls=cfg.parallel_tool_calls,
            live_agents=live.__len__,
        )
        with server:
            # one client and connection pool; each session's copy only sets its header. Plain
            # HTTP to loopback: the pool needs no CA bundle, whose load costs ~0.1 s a rollout
            pool = httpx.Client(verify=False, timeout=cfg.timeout_s)
            base = openai.OpenAI(
                base_url=server.base_url,
                api_key="rl3d",
                max_retries=0,
                timeout=cfg.timeout_s,
                http_client=pool,
            )

            def make_client(session: str) -> Any:
                return base.with_options(default_headers={"X-Session-Id": session})

            sessions = sessions or [f"sample-{i}" for i in range(len(samples))]
            try:
                return run_agents(
                    self.fn,
                    samples,
                    sessions,
                    make_client,
                    server.sessions.close,
                    concurrency=cfg.concurrency,
                    timeout_s=cfg.timeout_s,
                    live=live,
                )
            finally:
                base.close()


def agent_prompt(prompts: Any, p: int) -> Any:
    """What an agent gets as `sample["prompt"]`: a chat row's messages, else the prompt's text."""
    messages = prompts["messages"][p] if "messages" in prompts else None
    return [dict(m) for m in messages] if messages else prompts["prompt_text"][p]
