"""The reward of the `tool_multiply` task (`rl3d.data.tool_task`) from the whole trajectory.

    reward:
      fn: rl3d.rewards.tool_task:tool_multiply_reward

It reads `RewardInput.trajectory` (the tool loop's turns: text, call, observation) and scores
with `rl3d.data.tool_task.score_turns`; without a trajectory (a single-turn rollout) it splits
the response text at the observation tags instead, which gives the same turns.
"""

from __future__ import annotations

from rl3d.data.tool_task import (
    TOOL_MULTIPLY,
    call_expression,
    score_turns,
    turns_from_text,
)
from rl3d.rewards.base import RewardInput
from rl3d.tools.calculator import CalculatorError, evaluate


def tool_multiply_reward(inp: RewardInput) -> float:
    a, b = TOOL_MULTIPLY.operands(inp.prompt_ids)
    if inp.trajectory is None:
        turns = turns_from_text(inp.response_text)
    else:
        turns = [(t["text"], t["observation"]) for t in inp.trajectory["turns"]]
    return score_turns(a, b, turns)


def tool_multiply_metrics(step: int, batch, metrics: dict) -> dict[str, float]:
    """A `trainer.hooks.on_rollout_end` hook: what the policy does, beyond the reward's partial
    credit. Shares of the step's trajectories whose first turn makes a valid calculator call
    (`tool_task/call_valid`), whose call is exactly ``"a*b"`` (`tool_task/operands_exact`), and
    whose final answer is exactly the product (`tool_task/answer_exact`)."""
    valid = operands = answers = 0
    for prompt_ids, record in zip(batch["prompt_ids"], batch["trajectory"]):
        a, b = TOOL_MULTIPLY.operands(prompt_ids)
        turns = [(t["text"], t["observation"]) for t in record["turns"]]
        expression = call_expression(turns[0][0])
        if expression is not None:
            try:
                evaluate(expression, max_digits=40)
                valid += 1
            except CalculatorError:
                pass
            operands += expression.strip() == f"{a}*{b}"
        answers += len(turns) > 1 and turns[-1][0].strip() == str(a * b)
    n = max(len(batch["trajectory"]), 1)
    return {
        "tool_task/call_valid": valid / n,
        "tool_task/operands_exact": operands / n,
        "tool_task/answer_exact": answers / n,
    }
