"""`rollout.agent`: what drives a multi-turn rollout (`rl3d.agents`), one of two kinds.

    rollout:
      agent:
        kind: tool_loop                   # rl3d's tool loop, token level (rl3d.agents.tool_loop)
        max_turns: 3                      # generation turns per trajectory
        tools: [calculator]               # names or "pkg.mod:Class"; or {name: {option: value}}
        call_tags: ["<tool_call>", "</tool_call>"]
        observation_tags: ["<result>", "</result>"]
        tool_timeout_s: 10.0              # wall clock per call; later = an error observation
        max_observation_tokens: 256       # observation text tokens kept (tags come on top)
        concurrency: 8                    # tool calls run at once (a thread pool)

    rollout:
      agent:
        kind: endpoint            # implied by fn: a user's agent program (rl3d.agents.rollout)
        fn: my_pkg.agent:run      # run(client, sample) -> reward or (reward, info)
        concurrency: 8            # agents running at once (threads)
        timeout_s: 120.0          # wall clock per sample; later = scored 0, session closed
        tool_format: auto         # tool-call text: qwen (<tool_call>...), llama3 (JSON), auto
        max_rows_per_session: 1   # > 1: completions off the session's chain train too

With `endpoint`, `client` is an `openai.OpenAI` pointed at the rollout's endpoint and `sample`
the data row; the reward is the agent's (`reward.fn: rl3d.agents:agent_reward` reads it). With
`tool_loop`, `rollout.max_new_tokens` is the budget of the whole response: every turn's tokens
and every observation's. A key of the other kind must keep its default (it would be ignored).
Off (no kind, no fn) by default: a recipe without the block runs the single-turn path unchanged.

`rollout.multi_turn`, the tool loop's former section, still loads (`adopt_multi_turn`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from rl3d.config.errors import ConfigError, FieldError

logger = logging.getLogger(__name__)

AgentKind = Literal["tool_loop", "endpoint"]  # the entries of rl3d.agents.kinds.AGENT_KINDS


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """`rollout.agent` (both kinds' keys: the module's docstring)."""

    kind: AgentKind | None = None  # None: endpoint when fn is set, else off (single-turn)
    concurrency: int = 8  # tool calls (tool_loop) or agents (endpoint) running at once

    # -- tool_loop -------------------------------------------------------------------------------
    max_turns: int = 4
    tools: list[str] | dict[str, dict[str, Any]] = field(default_factory=lambda: ["calculator"])
    call_tags: list[str] = field(default_factory=lambda: ["<tool_call>", "</tool_call>"])
    observation_tags: list[str] = field(default_factory=lambda: ["<result>", "</result>"])
    tool_timeout_s: float = 10.0
    max_observation_tokens: int = 256

    # -- endpoint --------------------------------------------------------------------------------
    fn: str | None = None
    timeout_s: float = 300.0
    tool_format: Literal["auto", "qwen", "llama3"] = "auto"
    batch_wait_ms: float = 5.0  # how long the endpoint gathers requests into one generate call
    max_batch_rows: int = 64  # samples generated together at most
    max_body_bytes: int = 4 << 20  # a larger request body is refused (HTTP 413)
    # training rows per session: its longest chain of turns, then completions that do not
    # extend it, each its own sample with the session's reward (1: the chain alone)
    max_rows_per_session: int = 1
    # a reply that offers tools may make several calls (Qwen's blocks, Llama 3's JSON list);
    # false: it stops at the first call's close tag, as the tool loop does. A request's
    # `parallel_tool_calls` overrides.
    parallel_tool_calls: bool = False

    def __post_init__(self) -> None:
        positive = ("concurrency", "max_turns", "tool_timeout_s", "max_observation_tokens", "timeout_s")
        for key in (*positive, "max_batch_rows", "max_body_bytes", "max_rows_per_session"):
            if getattr(self, key) <= 0:
                raise FieldError(key, f"must be > 0, got {getattr(self, key)}")
        if self.batch_wait_ms < 0:
            raise FieldError("batch_wait_ms", f"must be >= 0, got {self.batch_wait_ms}")
        for key in ("call_tags", "observation_tags"):
            tags = getattr(self, key)
            if len(tags) != 2 or not all(tags) or tags[0] == tags[1]:
                raise FieldError(key, f"must be two different non-empty strings [open, close], got {tags!r}")
        if not self.tools:
            raise FieldError("tools", "name at least one tool (a built-in name or 'package.module:Class')")
        if self.kind is None and self.fn is not None:
            object.__setattr__(self, "kind", "endpoint")
        if self.kind is None:
            return
        ignored = [k for k in _KEYS[_OTHER[self.kind]] if getattr(self, k) != _DEFAULTS[k]]
        if ignored:
            raise FieldError(
                ignored[0], f"belongs to kind {_OTHER[self.kind]}; kind {self.kind} would ignore it"
            )
        if self.kind == "tool_loop":
            self.build_tools()  # an unknown tool or bad options fail here, naming the tool
        elif self.fn is None:
            raise FieldError("fn", "kind endpoint runs your agent function: set fn: package.module:run")
        else:
            self.resolve()  # a bad path fails here, naming the key

    @property
    def enabled(self) -> bool:
        return self.kind is not None

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

    def resolve(self) -> Any:
        """The agent function `fn` names."""
        from rl3d.utils.imports import import_object

        try:
            return import_object(self.fn, what="agent function")
        except ValueError as err:
            raise FieldError("fn", str(err)) from None


# the keys only one kind reads (`concurrency` is both kinds')
_KEYS = {
    "tool_loop": (
        "max_turns",
        "tools",
        "call_tags",
        "observation_tags",
        "tool_timeout_s",
        "max_observation_tokens",
    ),
    "endpoint": (
        "fn",
        "timeout_s",
        "tool_format",
        "batch_wait_ms",
        "max_batch_rows",
        "max_body_bytes",
        "max_rows_per_session",
        "parallel_tool_calls",
    ),
}
_OTHER = {"tool_loop": "endpoint", "endpoint": "tool_loop"}
_DEFAULTS = {
    f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(AgentConfig)
}

OLD_KEY, NEW_KEY = "rollout.multi_turn", "rollout.agent"


def adopt_multi_turn(data: dict[str, Any], sources: dict[str, str], source_of: Any) -> None:
    """Read `rollout.multi_turn` (the tool loop's former section) in `data` as `rollout.agent`,
    in place, with a deprecation warning naming the new key. `enabled: true` is `kind:
    tool_loop` (an error when `rollout.agent` names another agent), `enabled: false` turns a
    tool loop off, and the other keys are the tool loop's own, set on `rollout.agent` (with
    `enabled: false` they configure nothing and are dropped). `sources` (dotted key -> the file
    that set it) follows the keys, so later errors name the file."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or "multi_turn" not in rollout:
        return
    old = rollout.pop("multi_turn")
    where = source_of(OLD_KEY)
    if not isinstance(old, dict):
        raise ConfigError(f"expected a mapping, got {old!r}", key=OLD_KEY, source=where)
    agent = rollout.setdefault("agent", {})
    if not isinstance(agent, dict):
        raise ConfigError(f"expected a mapping, got {agent!r}", key=NEW_KEY, source=source_of(NEW_KEY))
    logger.warning(
        "%s%s is deprecated: write %s with kind: tool_loop (enabled: true becomes kind: tool_loop; "
        "max_turns, tools and the other keys keep their names)",
        f"{where}: " if where else "",
        OLD_KEY,
        NEW_KEY,
    )
    settings = dict(old)
    enabled = settings.pop("enabled", None)
    if enabled not in (None, True, False):
        raise ConfigError(f"expected true or false, got {enabled!r}", key=f"{OLD_KEY}.enabled", source=where)
    if enabled is False:
        if agent.get("kind") == "tool_loop":
            agent["kind"] = None
        return
    if enabled:
        other = agent.get("kind") not in (None, "tool_loop") or agent.get("fn") is not None
        if other:
            named = f"{NEW_KEY}.kind" if agent.get("kind") is not None else f"{NEW_KEY}.fn"
            raise ConfigError(
                f"the tool loop's deprecated switch, and {named} chooses another agent: keep one "
                f"(the tool loop is {NEW_KEY}.kind: tool_loop)",
                key=f"{OLD_KEY}.enabled",
                source=where,
            )
        agent["kind"] = "tool_loop"
        sources[f"{NEW_KEY}.kind"] = source_of(f"{OLD_KEY}.enabled") or where
    agent.update(settings)
    for key in list(sources):
        if key.startswith(f"{OLD_KEY}."):
            sources[NEW_KEY + key[len(OLD_KEY) :]] = sources[key]
