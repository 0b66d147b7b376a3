"""KL estimators (exactness in expectation, sign) and KL controllers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl3d import algos

PROPERTY = settings(max_examples=50, deadline=None)


def test_estimators_by_hand():
    # log pi = -1, log pi_ref = -1.5: log_r = -.5.
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert algos.kl_k1(logp, ref).item() == pytest.approx(0.5)
    assert algos.kl_k2(logp, ref).item() == pytest.approx(0.125)
    assert algos.kl_k3(logp, ref).item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert algos.get_kl_estimator("k3") is algos.kl_k3


def _exact_expectation(estimator, logits_p, logits_q):
    """E_{y~p}[k(y)] as an exact weighted sum over the support, and the exact KL(p || q)."""
    logp = torch.log_softmax(logits_p, -1)
    logq = torch.log_softmax(logits_q, -1)
    p = logp.exp()
    return (p * estimator(logp, logq)).sum().item(), (p * (logp - logq)).sum().item()


@PROPERTY
@given(
    num_outcomes=st.integers(2, 8),
    seed=st.integers(0, 10**6),
    scale=st.floats(0.1, 3.0),
    name=st.sampled_from(["k1", "k3"]),
)
def test_k1_and_k3_are_exact_in_expectation(num_outcomes, seed, scale, name):
    gen = torch.Generator().manual_seed(seed)
    logits_p = scale * torch.randn(num_outcomes, generator=gen, dtype=torch.float64)
    logits_q = scale * torch.randn(num_outcomes, generator=gen, dtype=torch.float64)
    expectation, exact_kl = _exact_expectation(algos.get_kl_estimator(name), logits_p, logits_q)
    assert expectation == pytest.approx(exact_kl, rel=1e-9, abs=1e-12)


def test_k1_monte_carlo_mean_converges_to_exact_kl():
    gen = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.tensor([1.0, 0.0, -1.0, 0.5]), torch.tensor([0.0, 0.3, 0.0, -0.5])
    logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    samples = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=gen)
    exact = (logp.exp() * (logp - logq)).sum().item()
    for name in ("k1", "k3"):
        estimate = algos.get_kl_estimator(name)(logp[samples], logq[samples]).mean().item()
        assert estimate == pytest.approx(exact, rel=0.03)


@PROPERTY
@given(
    logp=st.floats(-50.0, 0.0, allow_nan=False),
    delta=st.one_of(st.floats(-1e-6, 1e-6), st.floats(-40.0, 40.0)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_k2_and_k3_are_non_negative(logp, delta, dtype):
    logp_t = torch.tensor([logp], dtype=dtype)
    ref_t = torch.tensor([logp + delta], dtype=dtype)
    assert algos.kl_k3(logp_t, ref_t).item() >= 0.0
    assert algos.kl_k2(logp_t, ref_t).item() >= 0.0
    assert math.isfinite(algos.kl_k3(logp_t, ref_t).item())


def test_kl_penalty_rewards_ignores_padding():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    rewards, metrics = algos.kl_penalty_rewards(
        rewards_BT=torch.tensor([[0.0, 1.0, 5.0]]),
        logp_BT=torch.tensor([[-1.0, -2.0, float("nan")]]),
        ref_logp_BT=torch.tensor([[-1.0, -1.0, 0.0]]),
        mask_BT=mask,
        kl_coef=0.5,
        estimator="k2",
    )
    # k2 = [0, .5]; rewards - .5 * k2 = [0, .75]; padding is zero.
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.75, 0.0]]))
    assert metrics["kl"].item() == pytest.approx(0.25)


def test_fixed_controller_never_moves():
    controller = algos.make_kl_controller("fixed", kl_coef=0.05)
    controller.update(current_kl=100.0, num_steps=512)
    assert controller.value == 0.05
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        algos.make_kl_controller("fixed", kl_coef=-1.0)


def test_adaptive_controller_by_hand():
    # Ziegler et al.: e = clip(KL / target - 1, -.2, .2); beta *= 1 + e * n / horizon.
    controller = algos.make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10_000)
    controller.update(current_kl=9.0, num_steps=256)  # e = .5 -> clipped to .2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    before = controller.value
    controller.update(current_kl=6.0, num_steps=256)  # on target: no change
    assert controller.value == pytest.approx(before)
    controller.update(current_kl=5.4, num_steps=100)  # e = -.1, inside the clip
    assert controller.value == pytest.approx(before * (1 - 0.1 * 100 / 10_000))
    restored = algos.make_kl_controller("adaptive", kl_coef=1.0, target_kl=6.0, horizon=10_000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value


def test_adaptive_controller_converges_towards_target():
    # A toy environment whose KL is inversely proportional to the coefficient.
    controller = algos.AdaptiveKLController(kl_coef=0.01, target_kl=2.0, horizon=1000)
    for _ in range(2000):
        controller.update(current_kl=0.1 / controller.value, num_steps=64)
    assert 0.1 / controller.value == pytest.approx(2.0, rel=0.05)
