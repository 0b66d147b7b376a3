"""The tool loop (`rollout.agent.kind: tool_loop`): multi-turn rollouts with tool calls, over
any `RolloutEngine`, at the token level.

Each trajectory alternates policy turns and tool observations inside one response:

    prompt | turn 1 ... <tool_call>{...}</tool_call> | <result>42</result> | turn 2 ... EOS

A turn is generated until the call's close tag, a stop token, or the token budget. A call is
parsed (`rl3d.tools.ToolCallParser`), run (`rl3d.tools.ToolBox`, which never raises), and its
observation (tokenized text wrapped in the observation tags) is appended to the context. The
trajectory ends at a stop token (an answer), after `max_turns` turns, or when the response
reaches `max_new_tokens`, which budgets policy and observation tokens together.

Policy tokens carry the engine's log-probs and mask 1; observation tokens mask 0 (outside the
loss) and log-prob 0 (never used). Token ids are never re-tokenized: the context of the next
turn is the previous context's ids plus the new ones, so the trainer recomputes exactly the
conditionals the engine sampled from.

Concurrency: every round generates one turn for all live trajectories in one `generate` call
(the engine batches them); the calls of a round run together in a thread pool of `concurrency`
workers, each given `tool_timeout_s` of wall clock from its start. A call still running then
becomes a timeout observation and the round goes on, so a slow tool delays a round by at most
the timeout, however many calls are slow. (A thread cannot be killed: a tool that ignores its
own limits keeps its worker; the Python sandbox kills its child at its own wall limit.)
Rounds are synchronous, so a fixed seed gives the same trajectories.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from rl3d.agents.base import AgentRow
from rl3d.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams
from rl3d.tools import ToolBox, ToolCall, ToolCallError, ToolCallParser, ToolResult
from rl3d.tools.trajectory import trajectory_metrics  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003  # round r > 1 samples with seed * stride + r: fresh streams per round


@dataclass
class Trajectory:
    """One sample's multi-turn response. `mask` is 1 at policy tokens, 0 at observation tokens."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH
    done: bool = False
    num_calls: int = 0
    num_errors: int = 0
    num_timeouts: int = 0

    @property
    def num_observation_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    def record(self) -> dict[str, Any]:
        """What reward functions see (`RewardInput.trajectory`): every turn's text, its call
        (name, arguments, or the parse error), the observation, and the counts."""
        return {
            "turns": self.turns,
            "num_turns": len(self.turns),
            "num_calls": self.num_calls,
            "num_errors": self.num_errors,
            "num_timeouts": self.num_timeouts,
            "num_observation_tokens": self.num_observation_tokens,
            "num_policy_tokens": sum(self.mask),
        }


@dataclass(frozen=True, kw_only=True)
class ToolLoopConfig:
    """The loop's settings (`rl3d.config.agent.AgentConfig`'s, without the tool specs)."""

    max_turns: int = 4
    call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>")
    observation_tags: tuple[str, str] = ("<result>", "</result>")
    tool_timeout_s: float = 10.0
    max_observation_tokens: int = 256
    concurrency: int = 8

    @classmethod
    def from_config(cls, cfg: Any) -> ToolLoopConfig:
        return cls(
            max_turns=cfg.max_turns,
            call_tags=tuple(cfg.call_tags),
            observation_tags=tuple(cfg.observation_tags),
            tool_timeout_s=cfg.tool_timeout_s,
            max_observation_tokens=cfg.max_observation_tokens,
            concurrency=cfg.concurrency,
        )


class ToolLoop:
    """Runs multi-turn rollouts on `engine` with `tools`; `tokenizer` decodes turns (to find
    calls) and encodes observations (HF tokenizers and `rl3d.data` tokenizers alike)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, tools: ToolBox, config: ToolLoopConfig):
        self.engine, self.tokenizer, self.tools, self.config = engine, tokenizer, tools, config
        open_tag, close_tag = config.call_tags
        self.parser = ToolCallParser(open_tag=open_tag, close_tag=close_tag)
        self.close_tag = close_tag
        # tokens whose text holds the whole close tag also stop the engine (a tag spanning
        # several tokens is found in the turn's text, and the turn cut after it)
        self.close_ids = tuple(i for i in range(len(tokenizer)) if close_tag in self._decode([i]))
        self.obs_open_ids = self._encode(config.observation_tags[0])
        self.obs_close_ids = self._encode(config.observation_tags[1])
        self.pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="rl3d-tool")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # -- the loop --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Trajectory]:
        """`params.n` trajectories per prompt, prompt-major (as `RolloutEngine.generate`)."""
        trajectories = [
            Trajectory(prompt_index=i, prompt_ids=[int(t) for t in p])
            for i, p in enumerate(prompts)
            for _ in range(params.n)
        ]
        budget = params.max_new_tokens
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.close_ids)))
        live = trajectories
        for turn in range(1, self.config.max_turns + 1):
            longest = max(budget - len(t.response_ids) for t in live)
            if turn == 1:  # n samples share a prefill; the same draws as a single-turn rollout
                contexts, n, seed = [list(p) for p in prompts], params.n, params.seed
            else:
                contexts, n = [t.prompt_ids + t.response_ids for t in live], 1
                seed = None if params.seed is None else (params.seed * _SEED_STRIDE + turn) % 2**62
            out = self.engine.generate(
                contexts,
                dataclasses.replace(params, n=n, max_new_tokens=longest, stop_token_ids=stops, seed=seed),
            )
            ids, lps = out.responses(), out.token_logprobs()
            raws = out.token_logprobs(raw=True) if out.raw_logprobs is not None else lps
            calls: dict[int, ToolCall] = {}
            for row, traj in enumerate(live):
                call = self._take_turn(
                    traj, ids[row], lps[row], raws[row], out.finish_reasons[row], budget, turn
                )
                if isinstance(call, ToolCall):
                    calls[row] = call
            for row, result in self._run_tools(calls).items():
                self._observe(live[row], result, budget)
            live = [t for t in live if not t.done]
            if not live:
                break
        for traj in live:  # out of turns after a call: the observation was its last part
            traj.done = True
        return trajectories

    def _take_turn(
        self,
        traj: Trajectory,
        ids: list[int],
        lps: list[float],
        raws: list[float],
        finish: str,
        budget: int,
        turn: int,
    ) -> ToolCall | None:
        """Append one generated turn; returns the call to run, if any (errors are observed here)."""
        room = budget - len(traj.response_ids)
        cut = self._call_end(ids[:room])
        ends_call = cut is not None
        keep = cut if ends_call else min(len(ids), room)
        stopped = not ends_call and finish == FINISH_STOP and keep == len(ids)
        turn_ids = ids[:keep]
        traj.response_ids += turn_ids
        traj.logprobs += lps[:keep]
        traj.raw_logprobs += raws[:keep]
        traj.mask += [1] * keep
        text = self._decode(turn_ids)
        record: dict[str, Any] = {
            "turn": turn,
            "text": text,
            "call": None,
            "observation": None,
            "error": None,
        }
        traj.turns.append(record)
        if not ends_call:
            traj.done = True
            traj.finish_reason = FINISH_STOP if stopped else FINISH_LENGTH
            return None
        traj.num_calls += 1
        parsed = self.parser.parse(text)
        if parsed is None:  # a close tag without an open one
            parsed = ToolCallError(f"tool call has no opening {self.parser.open_tag!r}")
        if isinstance(parsed, ToolCallError):
            record["call"] = {"error": parsed.message}
            self._observe(traj, ToolResult("", error=parsed.message), budget)
            return None
        record["call"] = {"name": parsed.name, "arguments": parsed.arguments}
        if turn == self.config.max_turns:  # nobody would read the result: the trajectory ends
            traj.done = True
            return None
        return parsed

    def _call_end(self, ids: list[int]) -> int | None:
        """How many of `ids` make the turn up to and including the first call close tag."""
        if self.close_tag not in self._decode(ids):
            return None
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the tag
        while lo < hi:
            mid = (lo + hi) // 2
            if self.close_tag in self._decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _run_tools(self, calls: dict[int, ToolCall]) -> dict[int, ToolResult]:
        """Run the round's calls together; each gets `tool_timeout_s` from its own start."""
        if not calls:
            return {}
        started: dict[int, float] = {}

        def run(row: int, call: ToolCall) -> ToolResult:
            started[row] = time.monotonic()
            return self.tools.call(call.name, call.arguments)

        futures: dict[Future, int] = {self.pool.submit(run, row, call): row for row, call in calls.items()}
        results: dict[int, ToolResult] = {}
        timeout = self.config.tool_timeout_s
        while futures:
            done, _ = wait(list(futures), timeout=min(0.05, timeout), return_when=FIRST_COMPLETED)
            for fut in done:
                row = futures.pop(fut)
                try:
                    results[row] = fut.result()
                except Exception as err:  # ToolBox.call does not raise; this is a last guard
                    results[row] = ToolResult("", error=f"tool failed: {type(err).__name__}: {err}")
            now = time.monotonic()
            for fut, row in list(futures.items()):
                if row in started and now - started[row] > timeout:
                    futures.pop(fut)
                    fut.cancel()
                    logger.warning("tool %r timed out after %.1fs", calls[row].name, timeout)
                    results[row] = ToolResult(
                        "",
                        error=f"timed out after {timeout:g}s (rollout.agent.tool_timeout_s)",
                        timed_out=True,
                    )
        return results

    def _observe(self, traj: Trajectory, result: ToolResult, budget: int) -> None:
        """Append `result` as observation tokens (mask 0), cut to the budget."""
        if result.error is not None:
            traj.num_errors += 1
        traj.num_timeouts += int(result.timed_out)
        text = result.observation()
        traj.turns[-1]["observation"] = text
        traj.turns[-1]["error"] = result.error
        body = self._encode(text)[: self.config.max_observation_tokens] if text else []
        obs = (self.obs_open_ids + body + self.obs_close_ids)[: budget - len(traj.response_ids)]
        traj.response_ids += obs
        traj.logprobs += [0.0] * len(obs)
        traj.raw_logprobs += [0.0] * len(obs)
        traj.mask += [0] * len(obs)
        if len(traj.response_ids) >= budget:
            traj.done, traj.finish_reason = True, FINISH_LENGTH


class ToolLoopAgent:
    """The tool loop as an agent (`rl3d.agents.base.Agent`): the tools `cfg` names, run on
    `engine`; one row per trajectory, its prompt the prompt row's."""

    def __init__(self, cfg: Any, engine: RolloutEngine, tokenizer: Any):
        self.loop = ToolLoop(engine, tokenizer, cfg.build_tools(), ToolLoopConfig.from_config(cfg))

    def rollout(self, prompts: Any, params: SamplingParams) -> list[AgentRow]:
        trajectories = self.loop.generate(list(prompts["prompt_ids"]), params)  # prompt-major
        return [
            AgentRow(
                t.prompt_index,
                t.prompt_ids,
                t.response_ids,
                t.raw_logprobs,
                t.mask,
                t.finish_reason,
                t.record(),
            )
            for t in trajectories
        ]
