"""The reward of the `tool_multiply` task (`rl3d.data.tool_task`) from the whole trajectory.

    reward:
      fn: rl3d.rewards.tool_task:tool_multiply_reward

It reads `RewardInput.trajectory` (the agent loop's turns: text, call, observation) and scores
with `rl3d.data.tool_task.score_turns`; without a trajectory (a single-turn rollout) it splits
the response text at the observation tags instead, which gives the same turns.
"""

from __future__ import annotations

from rl3d.data.tool_task import TOOL_MULTIPLY, score_turns, turns_from_text
from rl3d.rewards.base import RewardInput


def tool_multiply_reward(inp: RewardInput) -> float:
    a, b = TOOL_MULTIPLY.operands(inp.prompt_ids)
    if inp.trajectory is None:
        turns = turns_from_text(inp.response_text)
    else:
        turns = [(t["text"], t["observation"]) for t in inp.trajectory["turns"]]
    return score_turns(a, b, turns)
