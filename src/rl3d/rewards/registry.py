"""Reward functions by name: built-ins, the synthetic tasks' own rewards, and user code.

`reward.fn` is one of:
- a built-in: ``gsm8k`` (strict), ``gsm8k_flexible``, ``gsm8k_format_credit``, ``math`` (the last
  ``\\boxed{}``), ``math_exact``, or a synthetic task's name (``parity_match``, ``copy_first``,
  ...: see `rl3d.data.synthetic`);
- ``synthetic``: the reward of the task in ``data.synthetic.task``;
- ``"package.module:function"``: user code, imported with importlib (never `eval`).

`reward.cost_fn` (Safe-RLHF's cost, higher = worse) is named the same way; the built-in cost
is ``high_token_ids`` (`resolve_cost_fn`).

`reward.fn_by_source` scores each row by its ``data_source`` column, as verl does: a map from
source to reward name over `SOURCE_REWARDS` (``openai/gsm8k`` -> ``gsm8k``; the MATH sets ->
``math``). A source in neither goes to `reward.fn` when that is set to something other than
the default ``synthetic``; otherwise the row is an error that names it (`UnknownSource`).

The config sections arrive as `rl3d.config.RewardConfig` / `DataConfig`. They are not imported
here: the config checks built-in names through this module before any rank starts, so config
imports rewards and never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl3d.data.gsm8k_synth import SOURCE as GSM8K_SYNTH_SOURCE
from rl3d.data.synthetic import SYNTHETIC_TASKS, SyntheticTask, get_synthetic_task
from rl3d.rewards.base import RewardFn, RewardInput
from rl3d.rewards.math_boxed import math_answer_check, math_reward
from rl3d.rewards.rule_based import (
    gsm8k_answer_check,
    gsm8k_flexible_reward,
    gsm8k_format_credit_reward,
    gsm8k_reward,
    math_exact_answer_check,
    math_exact_reward,
)
from rl3d.utils.imports import import_object, is_import_path
from rl3d.utils.registry import Registry


@dataclass(frozen=True)
class BuiltinReward:
    fn: RewardFn
    # Normalises a dataset answer and raises ValueError/TypeError for an unusable one; None when
    # the reward needs no answer. Handed to `load_prompt_dataset` so bad answers are bad rows.
    answer_check: Callable[[Any], Any] | None = None


USER_FN = "or a user function 'package.module:function'"
BUILTIN_REWARDS: Registry[BuiltinReward] = Registry(
    "reward", note=f"; or 'synthetic' (the task of data.synthetic.task), {USER_FN}"
)


def register_reward(name: str, fn: RewardFn, *, answer_check: Callable[[Any], Any] | None = None) -> None:
    assert name != "synthetic", "'synthetic' names the data's task, not a reward"
    fn.reward_name = name  # type: ignore[attr-defined]  # what score_batch's errors call it
    BUILTIN_REWARDS.register(name, BuiltinReward(fn, answer_check))


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
register_reward("gsm8k_flexible", gsm8k_flexible_reward, answer_check=gsm8k_answer_check)
register_reward("gsm8k_format_credit", gsm8k_format_credit_reward, answer_check=gsm8k_answer_check)
register_reward("math", math_reward, answer_check=math_answer_check)
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
    return BUILTIN_REWARDS[name] if name in BUILTIN_REWARDS else None


def _resolve_named(name: str, key: str) -> RewardFn:
    try:
        if is_import_path(name):
            return import_object(name, what="reward function")
        _builtin(name)
        return BUILTIN_REWARDS.get(name).fn  # unknown: the closest name in the error
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from err


def _answer_check_named(name: str) -> Callable[[Any], Any] | None:
    builtin = None if is_import_path(name) else _builtin(name)
    return builtin.answer_check if builtin is not None else None


def resolve_reward_fn(reward_cfg: Any, data_cfg: Any) -> RewardFn:
    """The function `reward.fn` (or `reward.fn_by_source`) names; ValueError naming the key
    and the problem otherwise. Built-in names are checked now, user functions when imported."""
    if reward_cfg.fn_by_source is not None:
        return SourceRoutedReward.from_config(reward_cfg, data_cfg)
    return _resolve_named(_resolve_name(reward_cfg, data_cfg), "reward.fn")


def answer_check_for(reward_cfg: Any, data_cfg: Any) -> Callable[..., Any] | None:
    """The dataset-answer check of the reward (None for user functions and answer-free rewards).
    With `reward.fn_by_source` it is a `SourceAnswerCheck`, called with the row's source too."""
    if reward_cfg.fn_by_source is not None:
        return SourceAnswerCheck(SourceRoutedReward.from_config(reward_cfg, data_cfg))
    return _answer_check_named(_resolve_name(reward_cfg, data_cfg))


# The reward of each well-known `data_source`, as verl routes them (and rl3d's own problems).
SOURCE_REWARDS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    GSM8K_SYNTH_SOURCE: "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
}


class UnknownSource(LookupError):
    """A row's `data_source` has no reward in `reward.fn_by_source` and no `reward.fn` to fall back on."""


class SourceRoutedReward:
    """`reward.fn_by_source` as one reward function: each response is scored by the reward of
    its row's `data_source`. Picklable (it holds names; functions are resolved on first use)."""

    reward_name = "fn_by_source"

    def __init__(self, table: dict[str, str], fallback: str | None):
        self.table, self.fallback = dict(table), fallback
        self._fns: dict[str, RewardFn] = {}

    @classmethod
    def from_config(cls, reward_cfg: Any, data_cfg: Any) -> SourceRoutedReward:
        table = {**SOURCE_REWARDS, **reward_cfg.fn_by_source}
        defaulted = reward_cfg.fn == "synthetic" and data_cfg.synthetic is None
        router = cls(table, None if defaulted else _resolve_name(reward_cfg, data_cfg))
        for source, name in reward_cfg.fn_by_source.items():
            if not is_import_path(name):
                _resolve_named(name, f"reward.fn_by_source.{source}")
        if router.fallback is not None and not is_import_path(router.fallback):
            _resolve_named(router.fallback, "reward.fn")
        return router

    def name_for(self, source: str | None) -> str:
        name = self.table.get(source) if source is not None else None
        if name is None:
            name = self.fallback
        if name is None:
            raise UnknownSource(
                f"data_source {source!r} has no reward: name one in reward.fn_by_source "
                f"(known sources: {', '.join(sorted(self.table))}) or set reward.fn for the rest"
            )
        return name

    def __call__(self, inp: RewardInput) -> float:
        name = self.name_for(inp.data_source)
        if name not in self._fns:
            self._fns[name] = _resolve_named(name, f"reward.fn_by_source.{inp.data_source}")
        return self._fns[name](inp)

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table, "fallback": self.fallback, "_fns": {}}


class SourceAnswerCheck:
    """The answer check of a `SourceRoutedReward`: the check of the row's source's reward.
    `load_prompt_dataset` calls it as ``check(answer, data_source)`` (`by_source`)."""

    by_source = True

    def __init__(self, router: SourceRoutedReward):
        self.router = router

    def __call__(self, answer: Any, data_source: str | None) -> Any:
        check = _answer_check_named(self.router.name_for(data_source))  # UnknownSource
        return answer if check is None else check(answer)


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
BUILTIN_COSTS: Registry[RewardFn] = Registry("cost", note=f", {USER_FN}")
BUILTIN_COSTS.register("high_token_ids", high_token_ids_cost)


def resolve_cost_fn(reward_cfg: Any) -> RewardFn | None:
    """The function `reward.cost_fn` names, or None when unset."""
    name = reward_cfg.cost_fn
    if name is None:
        return None
    try:
        if is_import_path(name):
            return import_object(name, what="cost function")
        return BUILTIN_COSTS.get(name)
    except ValueError as err:
        raise ValueError(f"reward.cost_fn: {err}") from err
