"""The agents a recipe names in `rollout.agent.kind`, and the one place a rollout builds its
agent from the recipe's section (`build_agent`)."""

from __future__ import annotations

from typing import Any

from rl3d.agents.base import Agent
from rl3d.agents.rollout import EndpointAgent
from rl3d.agents.tool_loop import ToolLoopAgent
from rl3d.utils.registry import Registry

AGENT_KINDS: Registry[type] = Registry("agent kind")
AGENT_KINDS.register("tool_loop", ToolLoopAgent)  # rl3d's tool loop, token level
AGENT_KINDS.register("endpoint", EndpointAgent)  # a user's agent function against the endpoint


def build_agent(cfg: Any, engine: Any, tokenizer: Any) -> Agent | None:
    """The agent `cfg` (`rl3d.config.agent.AgentConfig`) names on `engine`; None when it names
    none (single-turn rollouts)."""
    return None if cfg.kind is None else AGENT_KINDS.get(cfg.kind)(cfg, engine, tokenizer)
