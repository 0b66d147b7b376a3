"""Reward functions by name: built-ins, the synthetic tasks' own rewards, and user code.

`reward.fn` is one of:
- a built-in: ``gsm8k``, ``math_exact``, or a synthetic task's name (``parity_match``,
  ``copy_first``, ...: see `rl3d.data.synthetic`);
- ``synthetic``: the reward of the task in ``data.synthetic.task``;
- ``"package.module:function"``: user code, imported with importlib (never `eval`).

`reward.cost_fn` (Safe-RLHF's cost, higher = worse) is named the same way; the built-in cost
is ``high_token_ids`` (`resolve_cost_fn`).

The config sections arrive as `rl3d.config.RewardConfig` / `DataConfig`. They are not imported
here: the config checks built-in names through this module before any rank starts, so config
imports rewards and never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl3d.data.synthetic import SYNTHETIC_TASKS, SyntheticTask, get_synthetic_task
from rl3d.rewards.base import RewardFn, RewardInput
from rl3d.rewards.rule_based import (
    gsm8k_answer_check,
    gsm8k_reward,
    math_exact_answer_check,
    math_exact_reward,
)
from rl3d.utils.imports import import_object, is_import_path, suggest


@dataclass(frozen=True)
class BuiltinReward:
    fn: RewardFn
    # Normalises a dataset answer and raises ValueError/TypeError for an unusable one; None when
    # the reward needs no answer. Handed to `load_prompt_dataset` so bad answers are bad rows.
    answer_check: Callable[[Any], Any] | None = None


BUILTIN_REWARDS: dict[str, BuiltinReward] = {}


def register_reward(name: str, fn: RewardFn, *, answer_check: Callable[[Any], Any] | None = None) -> None:
    assert name not in BUILTIN_REWARDS and name != "synthetic", f"reward {name!r} registered twice"
    fn.reward_name = name  # type: ignore[attr-defined]  # what score_batch's errors call it
    BUILTIN_REWARDS[name] = BuiltinReward(fn, answer_check)


class SyntheticReward:
    """The reward of a synthetic task as a reward function (picklable: it holds the task's name)."""

    def __init__(self, task_name: str):
        self.task_name = task_name
        self.reward_name = task_name

    def __call__(self, inp: RewardInput) -> float:
        return get_synthetic_task(self.task_name).score(inp.prompt_ids, inp.response_ids, inp.finish_reason)

    def __repr__(self) -> str:
        return f"SyntheticReward({self.task_name!r})"


def synthetic_reward(task: SyntheticTask | str) -> RewardFn:
    return SyntheticReward(task if isinstance(task, str) else task.name)


register_reward("gsm8k", gsm8k_reward, answer_check=gsm8k_answer_check)
register_reward("math_exact", math_exact_reward, answer_check=math_exact_answer_check)
for _task in SYNTHETIC_TASKS.values():
    register_reward(_task.name, synthetic_reward(_task))


def _resolve_name(reward_cfg: Any, data_cfg: Any) -> str:
    if reward_cfg.fn != "synthetic":
        return reward_cfg.fn
    if data_cfg.synthetic is None:
        raise ValueError(
            "reward.fn: 'synthetic' means the reward of data.synthetic.task; data.synthetic is unset"
        )
    return get_synthetic_task(data_cfg.synthetic.task).name


def _builtin(name: str) -> BuiltinReward | None:
    if name not in BUILTIN_REWARDS and name in SYNTHETIC_TASKS:  # a task registered after import
        register_reward(name, synthetic_reward(SYNTHETIC_TASKS[name]))
    return BUILTIN_REWARDS.get(name)


def resolve_reward_fn(reward_cfg: Any, data_cfg: Any) -> RewardFn:
    """The function `reward.fn` names (ValueError naming the key and the problem otherwise)."""
    name = _resolve_name(reward_cfg, data_cfg)
    if is_import_path(name):
        try:
            return import_object(name, what="reward function")
        except ValueError as err:
            raise ValueError(f"reward.fn: {err}") from err
    builtin = _builtin(name)
    if builtin is None:
        known = sorted([*BUILTIN_REWARDS, "synthetic"])
        raise ValueError(
            f"reward.fn: unknown reward {name!r}{suggest(name, known)}; known: {', '.join(known)}, "
            "or a user function 'package.module:function'"
        )
    return builtin.fn


def answer_check_for(reward_cfg: Any, data_cfg: Any) -> Callable[[Any], Any] | None:
    """The dataset-answer check of the built-in `reward.fn` names (None for user functions)."""
    name = _resolve_name(reward_cfg, data_cfg)
    builtin = None if is_import_path(name) else _builtin(name)
    return builtin.answer_check if builtin is not None else None


def high_token_ids_cost(inp: RewardInput) -> float:
    """A checkable cost for the synthetic tasks: the fraction of response tokens in the upper
    half of their 256-id vocabulary (ids 128-255).

    A random policy pays about 0.5. The `parity_*` and `copy_*` rewards do not care about it
    (half the ids of either parity are cheap), so reward and cost can both be satisfied, but
    only a policy that learns the constraint does so: what Safe-RLHF's multiplier is for."""
    tokens = inp.response_ids
    if not tokens:
        return 0.0
    return sum(t >= HIGH_TOKEN_ID for t in tokens) / len(tokens)


HIGH_TOKEN_ID = 128
high_token_ids_cost.reward_name = "high_token_ids"  # type: ignore[attr-defined]
BUILTIN_COSTS: dict[str, RewardFn] = {"high_token_ids": high_token_ids_cost}


def resolve_cost_fn(reward_cfg: Any) -> RewardFn | None:
    """The function `reward.cost_fn` names, or None when unset."""
    name = reward_cfg.cost_fn
    if name is None:
        return None
    if is_import_path(name):
        try:
            return import_object(name, what="cost function")
        except ValueError as err:
            raise ValueError(f"reward.cost_fn: {err}") from err
    if name not in BUILTIN_COSTS:
        known = sorted(BUILTIN_COSTS)
        raise ValueError(
            f"reward.cost_fn: unknown cost {name!r}{suggest(name, known)}; known: {', '.join(known)}, "
            "or a user function 'package.module:function'"
        )
    return BUILTIN_COSTS[name]
