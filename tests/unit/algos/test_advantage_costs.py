"""The controller's advantage stage with a cost (Safe-RLHF) and the built-in cost function."""

import pytest
import torch

from rl3d import algos
from rl3d.algos.stage import compute_advantage
from rl3d.config.schema import AlgorithmConfig, RewardConfig
from rl3d.rewards import RewardInput, resolve_cost_fn
from rl3d.single_controller.batch import DataBatch


def _batch() -> DataBatch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return DataBatch(
        {
            "response_mask": mask,
            "score": torch.tensor([1.0, 0.0]),
            "cost": torch.tensor([0.5, 0.0]),
            "values": torch.zeros(2, 4),
            "cost_values": torch.zeros(2, 4),
            "uid": torch.tensor([0, 1]),
        }
    )


def test_safe_rlhf_advantage_trades_reward_against_cost_with_the_multiplier():
    cfg = AlgorithmConfig(adv_estimator="safe_rlhf", whiten_advantages=False, lam=1.0)
    batch, metrics = compute_advantage(
        _batch(), cfg, kl_coef=0.0, max_response_length=4, lagrange_multiplier=3.0
    )
    # gamma = lam = 1, zero values: every token's advantage is the episode's (reward - 3 cost) / 4
    expected = torch.tensor([[(1.0 - 1.5) / 4] * 3 + [0.0], [0.0] * 4])
    assert torch.allclose(batch["advantages"] * batch["response_mask"], expected)
    assert torch.equal(batch["cost_returns"][0, :3], torch.full((3,), 0.5))  # the cost critic's target
    assert metrics["cost/mean"] == pytest.approx(0.25)


def test_other_estimators_only_log_the_cost():
    cfg = AlgorithmConfig(adv_estimator="gae", whiten_advantages=False, lam=1.0)
    batch, metrics = compute_advantage(_batch(), cfg, kl_coef=0.0, max_response_length=4)
    assert "cost_returns" not in batch and metrics["cost/mean"] == pytest.approx(0.25)
    assert batch["advantages"][0, 0].item() == pytest.approx(1.0)  # the cost changed nothing


def test_a_missing_column_is_named_with_the_estimator():
    cfg = AlgorithmConfig(adv_estimator="safe_rlhf")
    batch = _batch()
    del batch.tensors["cost_values"]
    with pytest.raises(ValueError, match=r"'safe_rlhf' needs the batch column 'cost_values' for its"):
        compute_advantage(batch, cfg, kl_coef=0.0, max_response_length=4, lagrange_multiplier=1.0)
    del batch.tensors["values"]  # the estimator's first column is named first
    with pytest.raises(ValueError, match=r"'safe_rlhf' needs the batch column 'values' for its values_BT"):
        compute_advantage(batch, cfg, kl_coef=0.0, max_response_length=4, lagrange_multiplier=1.0)


def test_only_the_estimators_columns_are_read():
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", whiten_advantages=False)
    batch = _batch()
    for column in ("values", "cost_values", "uid"):  # none of them reinforce_plus_plus's
        del batch.tensors[column]
    batch, _ = compute_advantage(batch, cfg, kl_coef=0.0, max_response_length=4)
    assert batch["advantages"].shape == (2, 4)


def test_lagrange_multiplier_rises_above_the_threshold_and_falls_below():
    lam = algos.LagrangeMultiplier(init_value=1.0, cost_threshold=0.1, lr=0.5)
    assert lam.update(torch.tensor([0.5, 0.3])) > 1.0
    high = lam.value
    assert lam.update(torch.tensor([0.0, 0.0])) < high


def test_high_token_ids_cost_counts_the_upper_half_of_the_vocabulary():
    cost = resolve_cost_fn(RewardConfig(cost_fn="high_token_ids"))
    inp = RewardInput(
        prompt_index=0,
        prompt_ids=[1],
        response_ids=[5, 200, 128, 127],
        prompt_text="",
        response_text="",
        answer=None,
        finish_reason="stop",
    )
    assert cost(inp) == 0.5
    assert resolve_cost_fn(RewardConfig()) is None
    with pytest.raises(ValueError, match=r"reward\.cost_fn: unknown cost 'high_ids'"):
        resolve_cost_fn(RewardConfig(cost_fn="high_ids"))
