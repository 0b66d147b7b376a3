"""The step metrics of multi-turn rollouts, from the trajectory records that
`rl3d.rollout.agent_loop.Trajectory.record` makes (plain dicts: the trainer computes these from
the batch, where the records travel as a non-tensor field)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def trajectory_metrics(trajectories: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The step's tool metrics from `Trajectory.record()`s. `tool/errors` counts every failed
    call (malformed, unknown tool, bad arguments, exception, tool-reported error, timeout);
    `tool/timeouts` those that ran out of time."""
    n = max(len(trajectories), 1)
    obs = sum(t["num_observation_tokens"] for t in trajectories)
    total = obs + sum(t["num_policy_tokens"] for t in trajectories)
    return {
        "tool/calls_mean": sum(t["num_calls"] for t in trajectories) / n,
        "tool/errors": float(sum(t["num_errors"] for t in trajectories)),
        "tool/timeouts": float(sum(t["num_timeouts"] for t in trajectories)),
        "turns/mean": sum(t["num_turns"] for t in trajectories) / n,
        "response/tool_token_fraction": obs / total if total else 0.0,
    }
