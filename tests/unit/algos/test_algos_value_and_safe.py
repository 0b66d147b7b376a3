"""Clipped value loss, DAPO overlong penalty and Safe-RLHF (PPO-Lagrangian), by hand."""

import math

import pytest
import torch

from rl3d import algos

NAN = float("nan")


def test_clipped_value_loss_by_hand():
    # clip .2.  Token 0: V 1, V_old .5, R 2 -> V_clip .7: max(1, 1.69) = 1.69 (clip active).
    # Token 1: V 2, V_old 2.5, R 1 -> V_clip 2.3: max(1, 1.69) = 1.69 (active).
    # Token 2: V 0, V_old 1, R 2 -> V_clip .8: max(4, 1.44) = 4 (inactive). Token 3 is padding.
    values = torch.tensor([[1.0, 2.0, 0.0, NAN]], requires_grad=True)
    old_values = torch.tensor([[0.5, 2.5, 1.0, NAN]])
    returns = torch.tensor([[2.0, 1.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = algos.clipped_value_loss(
        values_BT=values, old_values_BT=old_values, returns_BT=returns, mask_BT=mask, clip_range=0.2
    )
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.69 + 4.0) / 3)
    assert metrics["vf_clipfrac"].item() == pytest.approx(2 / 3)
    # Returns 2, 1, 2 (var 1/3); residuals 1, -1, 2 (var 7/3): EV = 1 - 7 = -6.
    assert metrics["vf_explained_var"].item() == pytest.approx(-6.0)
    assert metrics["values_mean"].item() == pytest.approx(1.0)
    assert metrics["returns_mean"].item() == pytest.approx(5 / 3)
    loss.backward()
    # Clipped tokens get no gradient; token 2: d/dV 1/2 (V - R)^2 / 3 = (0 - 2) / 3.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, -2 / 3, 0.0]]))

    unclipped, _ = algos.clipped_value_loss(
        values_BT=values, old_values_BT=old_values, returns_BT=returns, mask_BT=mask, clip_range=None
    )
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 1.0 + 4.0) / 3)


def test_explained_variance_perfect_and_undefined():
    returns = torch.tensor([[1.0, 2.0, 4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert algos.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert algos.explained_variance(torch.full_like(returns, 7.0), returns, mask).item() == pytest.approx(
        0.0, abs=1e-6
    )
    assert math.isnan(algos.explained_variance(returns, torch.ones(1, 3), mask).item())


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: no penalty up to 16, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = algos.overlong_penalty(
        lengths, max_response_length=20, overlong_buffer_length=4, penalty_factor=0.5
    )
    torch.testing.assert_close(penalty, 0.5 * torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="overlong_buffer_length must be in"):
        algos.overlong_penalty(lengths, max_response_length=20, overlong_buffer_length=21)


def test_combined_advantage_by_hand():
    combined = algos.combine_advantages(
        torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), lagrange_multiplier=1.0
    )
    torch.testing.assert_close(combined, torch.tensor([0.25, 1.5]))
    # lambda = 0 is plain reward PPO.
    torch.testing.assert_close(
        algos.combine_advantages(torch.tensor([1.0]), torch.tensor([9.0]), lagrange_multiplier=0.0),
        torch.tensor([1.0]),
    )
    with pytest.raises(ValueError, match="lagrange_multiplier must be >= 0"):
        algos.combine_advantages(torch.zeros(1), torch.zeros(1), lagrange_multiplier=-0.1)


def test_safe_rlhf_advantages_by_hand():
    # One-token responses: A_R = r - V = 1 - .4 = .6, A_C = 2 - .5 = 1.5; lambda .5:
    # (0.6 - 0.75) / 1.5 = -0.1.  Second row is padding only.
    mask = torch.tensor([[1], [0]], dtype=torch.bool)
    out = algos.compute_advantages(
        "safe_rlhf",
        rewards_BT=torch.tensor([[1.0], [NAN]]),
        values_BT=torch.tensor([[0.4], [NAN]]),
        cost_rewards_BT=torch.tensor([[2.0], [NAN]]),
        cost_values_BT=torch.tensor([[0.5], [NAN]]),
        mask_BT=mask,
        lagrange_multiplier=0.5,
    )
    torch.testing.assert_close(out.adv_BT, torch.tensor([[-0.1], [0.0]]))
    torch.testing.assert_close(out.returns_BT, torch.tensor([[1.0], [0.0]]))
    torch.testing.assert_close(out.cost_returns_BT, torch.tensor([[2.0], [0.0]]))
    with pytest.raises(ValueError, match="needs cost_rewards_BT"):
        algos.compute_advantages(
            "safe_rlhf", rewards_BT=torch.ones(1, 1), values_BT=torch.ones(1, 1), mask_BT=mask[:1]
        )


def test_lagrange_step_is_gradient_ascent_on_the_lagrangian():
    # L(log_lambda) = exp(log_lambda) * (J_C - d); check the step against autograd's gradient.
    log_lambda = torch.tensor(math.log(0.7), requires_grad=True)
    cost, threshold, lr = 2.0, 0.5, 0.1
    (torch.exp(log_lambda) * (cost - threshold)).backward()
    expected = log_lambda.item() + lr * log_lambda.grad.item()
    got = algos.lagrange_step(log_lambda.item(), episode_cost=cost, cost_threshold=threshold, lr=lr)
    assert got == pytest.approx(expected)
    assert got == pytest.approx(math.log(0.7) + 0.1 * 0.7 * 1.5)


def test_lagrange_multiplier_grows_under_violation_and_decays_but_stays_positive():
    multiplier = algos.LagrangeMultiplier(init_value=1.0, cost_threshold=0.0, lr=0.05, max_value=5.0)
    values = [multiplier.update(torch.tensor([1.0, 3.0])) for _ in range(3)]  # mean cost 2 > 0
    assert values[0] == pytest.approx(math.exp(0.05 * 1.0 * 2.0))
    assert values == sorted(values)
    for _ in range(200):
        multiplier.update(torch.tensor([10.0]))
    assert multiplier.value == pytest.approx(5.0)  # capped at max_value
    for _ in range(2000):
        multiplier.update(torch.tensor([-1.0, -3.0]))  # constraint satisfied: lambda decays
    assert 0.0 < multiplier.value < 0.05
    restored = algos.LagrangeMultiplier(init_value=2.0, cost_threshold=0.0, lr=0.05)
    restored.load_state_dict(multiplier.state_dict())
    assert restored.value == multiplier.value


def test_vf_clipfrac_counts_no_token_inside_the_range():
    # |V - V_old| = 0.049 < 0.2, yet in float32 V_old + (V - V_old) is V + 9.3e-10, which is
    # farther from R: comparing the clipped loss with the unclipped one would count it clipped.
    values = torch.tensor([[-0.011422981508076191]])
    old_values = torch.tensor([[0.037389613687992096]])
    returns = torch.tensor([[-0.013237196952104568]])
    assert (old_values + (values - old_values) - returns) ** 2 > (values - returns) ** 2
    _, metrics = algos.clipped_value_loss(
        values_BT=values,
        old_values_BT=old_values,
        returns_BT=returns,
        mask_BT=torch.ones(1, 1, dtype=torch.bool),
    )
    assert metrics["vf_clipfrac"].item() == 0.0


def test_vf_clipfrac_over_random_tokens_counts_exactly_those_past_the_range_on_the_far_side():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(64, 256, generator=gen)
    old_values = values + torch.randn(64, 256, generator=gen) * 0.2
    returns = torch.randn(64, 256, generator=gen)
    mask = torch.ones(64, 256, dtype=torch.bool)
    _, metrics = algos.clipped_value_loss(
        values_BT=values, old_values_BT=old_values, returns_BT=returns, mask_BT=mask
    )
    v, o, r = (x.double() for x in (values, old_values, returns))
    exact = ((v - o).abs() > 0.2) & (((o + (v - o).clamp(-0.2, 0.2)) - r) ** 2 > (v - r) ** 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(exact.double().mean().item(), abs=1e-6)
