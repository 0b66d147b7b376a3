"""`rollout.multi_turn`: the agent loop's settings (see `rl3d.rollout.agent_loop`).

    rollout:
      multi_turn:
        enabled: true
        max_turns: 3                      # generation turns per trajectory
        tools: [calculator]               # names or "pkg.mod:Class"; or {name: {option: value}}
        call_tags: ["<tool_call>", "</tool_call>"]
        observation_tags: ["<result>", "</result>"]
        tool_timeout_s: 10.0              # wall clock per call; later = an error observation
        max_observation_tokens: 256       # observation text tokens kept (tags come on top)
        concurrency: 8                    # tool calls run at once (a thread pool)

`rollout.max_new_tokens` is the budget of the whole response: every turn's tokens and every
observation's. Off by default; a recipe without the block runs the single-turn path unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rl3d.config.errors import FieldError


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    enabled: bool = False
    max_turns: int = 4
    tools: list[str] | dict[str, dict[str, Any]] = field(default_factory=lambda: ["calculator"])
    call_tags: list[str] = field(default_factory=lambda: ["<tool_call>", "</tool_call>"])
    observation_tags: list[str] = field(default_factory=lambda: ["<result>", "</result>"])
    tool_timeout_s: float = 10.0
    max_observation_tokens: int = 256
    concurrency: int = 8

    def __post_init__(self) -> None:
        for key in ("max_turns", "tool_timeout_s", "max_observation_tokens", "concurrency"):
            if getattr(self, key) <= 0:
                raise FieldError(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("call_tags", "observation_tags"):
            tags = getattr(self, key)
            if len(tags) != 2 or not all(tags) or tags[0] == tags[1]:
                raise FieldError(key, f"must be two different non-empty strings [open, close], got {tags!r}")
        if not self.tools:
            raise FieldError("tools", "name at least one tool (a built-in name or 'package.module:Class')")
        if self.enabled:
            self.build_tools()  # an unknown tool or bad options fail here, naming the tool

    def tool_specs(self) -> dict[str, dict[str, Any]]:
        if isinstance(self.tools, dict):
            return {name: dict(options or {}) for name, options in self.tools.items()}
        return {name: {} for name in self.tools}

    def build_tools(self) -> Any:
        """The `rl3d.tools.ToolBox` of `tools` (FieldError naming `tools.<name>` otherwise)."""
        from rl3d.tools import ToolBox, build_tool

        built = []
        for name, options in self.tool_specs().items():
            try:
                built.append(build_tool(name, **options))
            except ValueError as err:
                raise FieldError(f"tools.{name}", str(err)) from None
        try:
            return ToolBox(built)
        except ValueError as err:
            raise FieldError("tools", str(err)) from None


@dataclass(frozen=True, kw_only=True)
class AgentHookConfig:
    """`rollout.agent`: a user's agent program drives the rollout (see `rl3d.agents`).

        rollout:
          agent:
            fn: my_pkg.agent:run      # run(client, sample) -> reward or (reward, info)
            concurrency: 8            # agents running at once (threads)
            timeout_s: 120.0          # wall clock per sample; later = scored 0, session closed
            tool_format: auto         # tool-call text: qwen (<tool_call>...), llama3 (JSON), auto
            max_rows_per_session: 1   # > 1: completions off the session's chain train too

    `client` is an `openai.OpenAI` pointed at the rollout's endpoint; `sample` the data row.
    The reward is the agent's (`reward.fn: rl3d.agents:agent_reward` reads it). Off (fn None)
    by default.
    """

    fn: str | None = None
    concurrency: int = 8
    timeout_s: float = 300.0
    tool_format: Literal["auto", "qwen", "llama3"] = "auto"
    batch_wait_ms: float = 5.0  # how long the endpoint gathers requests into one generate call
    max_batch_rows: int = 64  # samples generated together at most
    max_body_bytes: int = 4 << 20  # a larger request body is refused (HTTP 413)
    # training rows per session: its longest chain of turns, then completions that do not
    # extend it, each its own sample with the session's reward (1: the chain alone)
    max_rows_per_session: int = 1
    # a reply that offers tools may make several calls (Qwen's blocks, Llama 3's JSON list);
    # false: it stops at the first call's close tag, as the built-in loop does. A request's
    # `parallel_tool_calls` overrides.
    parallel_tool_calls: bool = False

    def __post_init__(self) -> None:
        for key in ("concurrency", "timeout_s", "max_batch_rows", "max_body_bytes", "max_rows_per_session"):
            if getattr(self, key) <= 0:
                raise FieldError(key, f"must be > 0, got {getattr(self, key)}")
        if self.batch_wait_ms < 0:
            raise FieldError("batch_wait_ms", f"must be >= 0, got {self.batch_wait_ms}")
        if self.fn is not None:
            self.resolve()  # a bad path fails here, naming the key

    @property
    def enabled(self) -> bool:
        return self.fn is not None

    def resolve(self) -> Any:
        from rl3d.utils.imports import import_object

        try:
            return import_object(self.fn, what="agent function")
        except ValueError as err:
            raise FieldError("fn", str(err)) from None
