"""The step metrics of multi-turn rollouts, from the trajectory records that
`rl3d.agents.tool_loop.Trajectory.record` and `rl3d.agents.rollout.agent_record` make (plain
dicts: the trainer computes these from the batch, where the records travel as a non-tensor
field)."""

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
    stats = agent_metrics(trajectories) if any("agent" in t for t in trajectories) else {}
    return stats | {
        "tool/calls_mean": sum(t["num_calls"] for t in trajectories) / n,
        "tool/errors": float(sum(t["num_errors"] for t in trajectories)),
        "tool/timeouts": float(sum(t["num_timeouts"] for t in trajectories)),
        "turns/mean": sum(t["num_turns"] for t in trajectories) / n,
        "response/tool_token_fraction": obs / total if total else 0.0,
    }


def agent_metrics(trajectories: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per agent session (a session may make several rows): `agent/errors` and `agent/timeouts`
    count the sessions that failed or ran out of time; `agent/calls_mean` the completions a
    session asked for, `agent/turns_mean` its longest chain of turns, `agent/seconds_mean` its
    wall clock; `agent/extra_rows` the rows beyond one per session (completions that do not
    extend the session's chain, trained as their own samples), `agent/unused_completions` the
    completions in none of the session's rows (past `rollout.agent.max_rows_per_session`)."""
    sessions = list({t["agent"]["session"]: t["agent"] for t in trajectories if "agent" in t}.values())
    n = max(len(sessions), 1)
    return {
        "agent/errors": float(sum(s["error"] is not None and not s["timed_out"] for s in sessions)),
        "agent/timeouts": float(sum(s["timed_out"] for s in sessions)),
        "agent/calls_mean": sum(s["calls"] for s in sessions) / n,
        "agent/turns_mean": sum(s["turns"] for s in sessions) / n,
        "agent/seconds_mean": sum(s["seconds"] for s in sessions) / n,
        "agent/extra_rows": float(sum(max(s.get("rows", 1) - 1, 0) for s in sessions)),
        "agent/unused_completions": float(sum(s.get("unused_completions", 0) for s in sessions)),
    }
