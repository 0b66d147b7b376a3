"""rl3d.rewards: score responses.

    fn = resolve_reward_fn(cfg.reward, cfg.data)
    scores, report = score_batch(fn, [RewardInput(...), ...], on_error=cfg.reward.on_error)

Built-ins: ``gsm8k`` (strict), ``gsm8k_flexible``, ``gsm8k_format_credit``, ``math`` (the last
``\\boxed{}``), ``math_exact``, the synthetic tasks (``parity_match``, ``copy_first``) and
``synthetic`` (= the task in ``data.synthetic.task``); or a user ``"package.module:function"``.
``reward.fn_by_source`` picks one per row by its ``data_source`` (`SOURCE_REWARDS`).
Safe-RLHF's cost: ``resolve_cost_fn(cfg.reward)`` (built-in ``high_token_ids``, or user code).
"""

from rl3d.rewards.base import RewardError, RewardFn, RewardInput, ScoreReport, reward_fn_name, score_batch
from rl3d.rewards.math_boxed import math_reward
from rl3d.rewards.registry import (
    BUILTIN_REWARDS,
    SOURCE_REWARDS,
    answer_check_for,
    register_reward,
    resolve_cost_fn,
    resolve_reward_fn,
    synthetic_reward,
)
from rl3d.rewards.rule_based import (
    extract_gsm8k_answer,
    gsm8k_flexible_reward,
    gsm8k_reward,
    math_exact_reward,
    parse_number,
)

__all__ = [
    "BUILTIN_REWARDS",
    "SOURCE_REWARDS",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "ScoreReport",
    "answer_check_for",
    "extract_gsm8k_answer",
    "gsm8k_flexible_reward",
    "gsm8k_reward",
    "math_exact_reward",
    "math_reward",
    "parse_number",
    "register_reward",
    "resolve_cost_fn",
    "resolve_reward_fn",
    "reward_fn_name",
    "score_batch",
    "synthetic_reward",
]
