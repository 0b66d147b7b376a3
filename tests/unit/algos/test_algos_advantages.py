"""Advantage estimators: hand-computed values and property tests against independent loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl3d import algos

NAN = float("nan")
PROPERTY = settings(max_examples=40, deadline=None)


def _batch(seed: int, num_rows: int, num_tokens: int):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
    values = torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
    mask = torch.rand(num_rows, num_tokens, generator=gen) < 0.7
    mask[:, 0] = True  # every row has a response, so group statistics are defined
    return rewards, values, mask


def _with_garbage(x, mask, value=NAN):
    return torch.where(mask, x, torch.full_like(x, value))


# ---- GAE -------------------------------------------------------------------------------------


def test_gae_by_hand():
    # Row 0: r = [0, 0, 1], V = [.5, .6, .7], gamma .9, lam .8:
    #   A2 = 1 - .7 = .3;  A1 = (.9*.7 - .6) + .72*.3 = .246;  A0 = (.9*.6 - .5) + .72*.246 = .21712
    # Row 1: last token is padding (garbage there): A1 = 2 - 1 = 1; A0 = (.9*1 - 1) + .72*1 = .62
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 1e9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = algos.gae_advantages(
        rewards_BT=rewards, values_BT=values, mask_BT=mask, gamma=0.9, lam=0.8, whiten=False
    )
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3], [0.62, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.adv_BT, expected_adv)
    torch.testing.assert_close(
        out.returns_BT, expected_adv + torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 0.0]]).double()
    )
    whitened = algos.gae_advantages(rewards_BT=rewards, values_BT=values, mask_BT=mask, gamma=0.9, lam=0.8)
    valid = expected_adv[mask]
    torch.testing.assert_close(
        whitened.adv_BT[mask], (valid - valid.mean()) / valid.std(), atol=1e-6, rtol=1e-6
    )


def _gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's valid tokens only, written as a plain Python loop."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t]]
        r = [rewards[i, t].item() for t in positions]
        v = [values[i, t].item() for t in positions] + [0.0]
        running = 0.0
        for k in reversed(range(len(r))):
            running = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * running
            adv[i, positions[k]] = running
    return adv


@PROPERTY
@given(
    num_rows=st.integers(1, 4),
    num_tokens=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_matches_reference_loop_and_ignores_padding(num_rows, num_tokens, seed, gamma, lam):
    rewards, values, mask = _batch(seed, num_rows, num_tokens)
    out = algos.gae_advantages(
        rewards_BT=_with_garbage(rewards, mask),
        values_BT=_with_garbage(values, mask, 1e30),
        mask_BT=mask,
        gamma=gamma,
        lam=lam,
        whiten=False,
    )
    expected = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(out.adv_BT, expected)
    torch.testing.assert_close(out.returns_BT, torch.where(mask, expected + values, 0.0))


# ---- GRPO / RLOO -----------------------------------------------------------------------------


def test_grpo_by_hand_with_interleaved_groups():
    # Group 7: scores 1, 0, 0, 1 -> mean .5, unbiased std sqrt(1/3).  Group 3: 2, 4, 6 -> mean 4, std 2.
    group_ids = torch.tensor([7, 3, 7, 7, 3, 7, 3])
    scores = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0, 6.0])
    mask = torch.ones(7, 2, dtype=torch.bool)
    mask[1, 1] = False
    rewards = algos.scores_to_token_rewards(scores, mask)
    out = algos.grpo_advantages(rewards_BT=rewards, mask_BT=mask, group_ids_B=group_ids, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    expected_B = torch.tensor([a, -1.0, -a, -a, 0.0, a, 1.0])
    torch.testing.assert_close(out.adv_BT, torch.where(mask, expected_B[:, None], 0.0))
    unnormalised = algos.grpo_advantages(
        rewards_BT=rewards, mask_BT=mask, group_ids_B=group_ids, norm_by_std=False
    )
    torch.testing.assert_close(
        unnormalised.adv_BT[:, 0], torch.tensor([0.5, -2.0, -0.5, -0.5, 0.0, 0.5, 2.0])
    )


def test_grpo_all_equal_group_gets_zero_advantage():
    out = algos.grpo_advantages(
        rewards_BT=torch.ones(3, 1), mask_BT=torch.ones(3, 1, dtype=torch.bool), group_ids_B=torch.zeros(3)
    )
    assert torch.equal(out.adv_BT, torch.zeros(3, 1))


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_estimators_reject_singleton_groups(name):
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        algos.compute_advantages(
            name, rewards_BT=torch.ones(3, 1), mask_BT=torch.ones(3, 1), group_ids_B=torch.tensor([0, 0, 1])
        )


def test_rloo_by_hand():
    # Scores 1, 2, 6: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5.
    scores = torch.tensor([1.0, 2.0, 6.0])
    mask = torch.ones(3, 2, dtype=torch.bool)
    out = algos.rloo_advantages(
        rewards_BT=algos.scores_to_token_rewards(scores, mask), mask_BT=mask, group_ids_B=torch.zeros(3)
    )
    torch.testing.assert_close(out.adv_BT, torch.tensor([[-3.0, -3.0], [-1.5, -1.5], [4.5, 4.5]]))


def _group_ids(seed: int, num_rows: int, num_groups: int) -> torch.Tensor:
    # Every group gets at least two rows; the order is shuffled so groups interleave.
    ids = torch.arange(num_rows) % num_groups
    return ids[torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))] * 11 + 5


@PROPERTY
@given(
    num_groups=st.integers(1, 3),
    per_group=st.integers(2, 4),
    num_tokens=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
def test_grpo_zero_mean_unit_std_per_group_and_padding_invariance(num_groups, per_group, num_tokens, seed):
    num_rows = num_groups * per_group
    rewards, _, mask = _batch(seed, num_rows, num_tokens)
    group_ids = _group_ids(seed, num_rows, num_groups)
    out = algos.grpo_advantages(
        rewards_BT=_with_garbage(rewards, mask), mask_BT=mask, group_ids_B=group_ids, eps=0.0
    )
    clean = algos.grpo_advantages(rewards_BT=rewards, mask_BT=mask, group_ids_B=group_ids, eps=0.0)
    torch.testing.assert_close(out.adv_BT, clean.adv_BT)
    assert torch.all(out.adv_BT[~mask] == 0)
    adv_B = out.adv_BT[:, 0]  # token 0 is always valid
    scores_B = torch.where(mask, rewards, 0.0).sum(-1)
    for gid in group_ids.unique():
        members = group_ids == gid
        assert adv_B[members].sum().item() == pytest.approx(0.0, abs=1e-9)
        if scores_B[members].std() > 1e-6:
            assert adv_B[members].std().item() == pytest.approx(1.0, rel=1e-6)


@PROPERTY
@given(
    num_groups=st.integers(1, 3),
    per_group=st.integers(2, 4),
    num_tokens=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
def test_rloo_equals_direct_leave_one_out_loop(num_groups, per_group, num_tokens, seed):
    num_rows = num_groups * per_group
    rewards, _, mask = _batch(seed, num_rows, num_tokens)
    group_ids = _group_ids(seed, num_rows, num_groups)
    out = algos.rloo_advantages(rewards_BT=_with_garbage(rewards, mask), mask_BT=mask, group_ids_B=group_ids)
    scores = [sum(rewards[i, t].item() for t in range(num_tokens) if mask[i, t]) for i in range(num_rows)]
    for i in range(num_rows):
        others = [scores[j] for j in range(num_rows) if j != i and group_ids[j] == group_ids[i]]
        expected = scores[i] - sum(others) / len(others)
        for t in range(num_tokens):
            assert out.adv_BT[i, t].item() == pytest.approx(expected if mask[i, t] else 0.0, abs=1e-9)


# ---- REINFORCE++ / ReMax ---------------------------------------------------------------------


def test_reinforce_plus_plus_by_hand():
    # gamma 1: returns row 0 = [1, 1, 1], row 1 = [-1, -1, pad]; valid mean .2, unbiased var 1.2.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = algos.reinforce_plus_plus_advantages(rewards_BT=rewards, mask_BT=mask)
    hi, lo = 0.8 / math.sqrt(1.2), -1.2 / math.sqrt(1.2)
    torch.testing.assert_close(out.adv_BT, torch.tensor([[hi, hi, hi], [lo, lo, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out.returns_BT, torch.tensor([[1.0, 1, 1], [-1, -1, 0]], dtype=torch.float64))
    discounted = algos.reinforce_plus_plus_advantages(rewards_BT=rewards, mask_BT=mask, gamma=0.5)
    torch.testing.assert_close(discounted.returns_BT[0], torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64))


def test_reinforce_plus_plus_with_token_level_kl_in_reward():
    # Outcome 1 on the last token, k1 KL .5 per token at coefficient .1: rewards [-.05, -.05, .95].
    mask = torch.ones(1, 3, dtype=torch.bool)
    rewards, metrics = algos.kl_penalty_rewards(
        rewards_BT=torch.tensor([[0.0, 0.0, 1.0]]),
        logp_BT=torch.full((1, 3), -1.0),
        ref_logp_BT=torch.full((1, 3), -1.5),
        mask_BT=mask,
        kl_coef=0.1,
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.05, 0.95]]))
    assert metrics["kl"].item() == pytest.approx(0.5)
    out = algos.reinforce_plus_plus_advantages(rewards_BT=rewards, mask_BT=mask)
    torch.testing.assert_close(out.returns_BT, torch.tensor([[0.85, 0.9, 0.95]]))


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = algos.remax_advantages(rewards_BT=rewards, mask_BT=mask, greedy_scores_B=torch.tensor([0.4, 1.0]))
    torch.testing.assert_close(out.adv_BT, torch.tensor([[0.6, 0.6, 0.6], [-0.5, -0.5, 0.0]]))
    with pytest.raises(ValueError, match="greedy_scores_B has shape"):
        algos.remax_advantages(rewards_BT=rewards, mask_BT=mask, greedy_scores_B=torch.zeros(3))


@PROPERTY
@given(num_rows=st.integers(2, 4), num_tokens=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_padding_never_changes_any_estimator(num_rows, num_tokens, seed):
    rewards, values, mask = _batch(seed, num_rows, num_tokens)
    greedy = torch.randn(num_rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for name in ("gae", "reinforce_plus_plus", "remax"):
        kwargs = dict(mask_BT=mask, values_BT=values, greedy_scores_B=greedy)
        clean = algos.compute_advantages(name, rewards_BT=rewards, **kwargs)
        kwargs["values_BT"] = _with_garbage(values, mask, -1e30)
        dirty = algos.compute_advantages(name, rewards_BT=_with_garbage(rewards, mask), **kwargs)
        torch.testing.assert_close(dirty.adv_BT, clean.adv_BT)
        torch.testing.assert_close(dirty.returns_BT, clean.returns_BT)
        assert torch.all(dirty.adv_BT[~mask] == 0) and torch.all(dirty.returns_BT[~mask] == 0)


# ---- DAPO dynamic sampling -------------------------------------------------------------------


def test_dynamic_sampling_drops_groups_with_equal_scores():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.3, 0.3001])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    keep = algos.dynamic_sampling_mask(scores, group_ids)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, True, True]
    assert keep.nonzero().squeeze(-1).tolist() == [2, 3, 8, 9]
    loose = algos.dynamic_sampling_mask(scores, group_ids, atol=1e-3)
    assert loose.tolist() == [False, False, True, True] + [False] * 6
