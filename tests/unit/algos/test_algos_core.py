"""Masked reductions and loss aggregation, against hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl3d.algos import core

NAN = float("nan")

# Two real rows and one padding row; padding holds NaN/inf, which must never leak into results.
LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, math.inf], [NAN, 9.0, 9.0]])
MASK_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


def test_masked_statistics_by_hand():
    assert core.masked_sum(LOSS_BT, MASK_BT).item() == pytest.approx(10.0)
    assert core.masked_mean(LOSS_BT, MASK_BT).item() == pytest.approx(2.5)
    # values 1,2,3,4: squared deviations from 2.5 sum to 5; unbiased /3, biased /4.
    assert core.masked_var(LOSS_BT, MASK_BT).item() == pytest.approx(5 / 3)
    assert core.masked_var(LOSS_BT, MASK_BT, unbiased=False).item() == pytest.approx(5 / 4)
    assert core.masked_mean(LOSS_BT, torch.zeros_like(MASK_BT)).item() == 0.0


def test_masked_whiten_by_hand():
    std = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5, -0.5, 0.5], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]]) / std
    torch.testing.assert_close(core.masked_whiten(LOSS_BT, MASK_BT, eps=0.0), expected)
    kept_mean = core.masked_whiten(LOSS_BT, MASK_BT, eps=0.0, shift_mean=False)
    torch.testing.assert_close(kept_mean[MASK_BT], expected[MASK_BT] + 2.5)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
    ],
)
def test_loss_aggregation_by_hand(mode, expected):
    assert core.aggregate_loss(LOSS_BT, MASK_BT, mode=mode).item() == pytest.approx(expected)


def test_loss_aggregation_gradient_is_zero_at_padding():
    loss = LOSS_BT.clone().requires_grad_(True)
    core.aggregate_loss(loss, MASK_BT, mode="seq-mean-token-mean").backward()
    expected = torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(loss.grad, expected)


def test_scores_to_token_rewards_puts_the_score_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    rewards = core.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 2.0], [0, 0, 0, 0], [0, 0, 4.0, 0]])
    torch.testing.assert_close(rewards, expected)


def test_discounted_returns_step_over_padding():
    rewards = torch.tensor([[1.0, 99.0, 2.0, 4.0]])
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    # valid rewards 1, 2, 4 with gamma 0.5: G = [1 + 0.5 * 4, 2 + 0.5 * 4, 4] = [3, 4, 4].
    torch.testing.assert_close(
        core.discounted_returns(rewards, mask, gamma=0.5), torch.tensor([[3.0, 0.0, 4.0, 4.0]])
    )


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"values_BT has shape \(2, 3\), expected mask shape \(2, 4\)"):
        core.check_same_shape(torch.ones(2, 4), values_BT=torch.ones(2, 3))


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 5),
    num_tokens=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
)
def test_aggregation_ignores_padding_and_padding_rows(num_rows, num_tokens, seed, mode):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
    mask = torch.rand(num_rows, num_tokens, generator=gen) < 0.6
    garbage = torch.where(mask, loss, torch.full_like(loss, 1e30))
    padded = torch.cat([garbage, torch.full((2, num_tokens), NAN, dtype=torch.float64)])
    padded_mask = torch.cat([mask, torch.zeros(2, num_tokens, dtype=torch.bool)])
    expected = core.aggregate_loss(loss, mask, mode=mode)
    torch.testing.assert_close(core.aggregate_loss(padded, padded_mask, mode=mode), expected)
    # Independent loop over the valid entries.
    rows = [loss[i][mask[i]].tolist() for i in range(num_rows) if mask[i].any()]
    if mode == "token-mean":
        flat = [x for row in rows for x in row]
        ref = sum(flat) / max(len(flat), 1)
    elif mode == "seq-mean-token-sum":
        ref = sum(sum(row) for row in rows) / max(len(rows), 1)
    else:
        ref = sum(sum(row) / len(row) for row in rows) / max(len(rows), 1)
    assert expected.item() == pytest.approx(ref, abs=1e-12)
