"""What an agent is to a rollout: it takes a generation rank's share of the step's prompts and
returns training rows (`AgentRow`), `params.n` samples of each prompt or more, prompt-major.

Two kinds, named by `rollout.agent.kind` (`rl3d.agents.kinds`): `tool_loop`, rl3d's tool loop
at the token level (`rl3d.agents.tool_loop`), and `endpoint`, a user's agent program against an
OpenAI-compatible endpoint (`rl3d.agents.rollout`). `rl3d.workers.generation` lays the rows out
as the trainer's batch, the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class AgentRow:
    """One training row: `prompt_ids`, the first prompt the engine saw, then `response_ids`,
    every later token, with `logprobs` (the engine's raw, temperature-1 log-probs; 0 outside the
    loss) and `mask` (1 at generated tokens, 0 at tool results and template text) per response
    token. `record` is what reward functions read (`RewardInput.trajectory`)."""

    prompt_index: int  # the prompt's row in the share
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish_reason: str
    record: dict[str, Any]


class Agent(Protocol):
    """Built as `Agent(cfg, engine, tokenizer)` (`cfg`: `rl3d.config.agent.AgentConfig`)."""

    def rollout(self, prompts: Any, params: Any) -> list[AgentRow]:
        """The rows of `prompts` (a `DataBatch` share) sampled with `params` (`SamplingParams`)."""
        ...
