"""Policy losses: PPO clip, clip-higher, dual clip, entropy bonus, KL in loss; metrics and masking."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl3d import algos

NAN = float("nan")

# ratios 1.5, .5, 1.1, .7 with advantages 1, 1, -1, -1; the last token is padding.
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 0.7, 3.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, NAN]])
MASK = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)


def _loss(ratios=RATIOS, adv=ADV, mask=MASK, **kwargs):
    logp = torch.log(ratios).requires_grad_(True)
    loss, metrics = algos.ppo_policy_loss(
        logp_BT=logp, old_logp_BT=torch.zeros_like(ratios), adv_BT=adv, mask_BT=mask, **kwargs
    )
    return loss, metrics, logp


def test_ppo_clip_by_hand():
    # Per token max(-A r, -A clip(r, .8, 1.2)): max(-1.5, -1.2) = -1.2 (clipped); max(-.5, -.8) = -.5;
    # max(1.1, 1.1) = 1.1; max(.7, .8) = .8 (clipped). Token mean = .2 / 4.
    loss, metrics, logp = _loss()
    assert loss.item() == pytest.approx(0.05)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["adv_mean"].item() == pytest.approx(0.0)
    assert metrics["adv_std"].item() == pytest.approx(math.sqrt(4 / 3))
    # approx KL(pi_old || pi) with k3 on r: mean of (r - 1) - log r.
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)]
    assert metrics["approx_kl"].item() == pytest.approx(sum(k3) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    # d/dlogp of -A r is -A r where the clip is inactive and 0 where it is active.
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0, 0.0]]) / 4)


def test_clip_higher_by_hand():
    # clip_high .28 only moves token 0: max(-1.5, -1.28) = -1.28; token 3 still clips at .8.
    loss, metrics, _ = _loss(clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


def test_dual_clip_by_hand():
    # r = 5, A = -1: PPO gives max(5, 1.2) = 5, dual clip caps at c * |A| = 3.
    # r = 2, A = -2: max(4, 2.4) = 4 < 6, untouched.  r = 5, A = 1: -1.2, dual clip ignores A > 0.
    ratios, adv = torch.tensor([[5.0, 2.0, 5.0]]), torch.tensor([[-1.0, -2.0, 1.0]])
    loss, metrics, logp = _loss(ratios, adv, torch.ones(1, 3, dtype=torch.bool), dual_clip_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 4.0 - 1.2) / 3)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    loss.backward()
    # Only token 1 carries gradient: d(-A r)/dlogp = -A r = 4.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 4.0, 0.0]]) / 3)


def test_entropy_bonus_and_kl_loss_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 2.0, NAN]])
    ref_logp = torch.log(RATIOS) + 0.5  # log_r = .5 on every token
    loss, metrics, _ = _loss(entropy_BT=entropy, entropy_coef=0.1, ref_logp_BT=ref_logp, kl_loss_coef=0.2)
    k3 = math.exp(0.5) - 1 - 0.5
    assert metrics["entropy"].item() == pytest.approx(2.0)
    assert metrics["kl_loss"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.05 - 0.1 * 2.0 + 0.2 * k3)
    k1_loss, k1_metrics, _ = _loss(ref_logp_BT=ref_logp, kl_loss_coef=1.0, kl_estimator="k1")
    assert k1_metrics["kl_loss"].item() == pytest.approx(-0.5)
    assert k1_loss.item() == pytest.approx(0.05 - 0.5)


def test_seq_mean_token_mean_aggregation_weights_sequences_equally():
    # Row 0: two tokens with loss -1 * 1 = -1 each (ratio 1, A = 1); row 1: one token with loss 3.
    ratios = torch.ones(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    token_mean, _, _ = _loss(ratios, adv, mask)
    seq_mean, _, _ = _loss(ratios, adv, mask, loss_agg_mode="seq-mean-token-mean")
    seq_sum, _, _ = _loss(ratios, adv, mask, loss_agg_mode="seq-mean-token-sum")
    assert token_mean.item() == pytest.approx((-1 - 1 + 3) / 3)
    assert seq_mean.item() == pytest.approx((-1 + 3) / 2)
    assert seq_sum.item() == pytest.approx((-2 + 3) / 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 0.0}, "clip_low must be in"),
        ({"clip_high": -0.1}, "clip_high must be > 0"),
        ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1"),
        ({"kl_loss_coef": 0.1}, "ref_logp_BT was not given"),
        ({"entropy_coef": 0.1}, "entropy_BT was not given"),
        ({"loss_agg_mode": "token_mean"}, "did you mean 'token-mean'"),
    ],
)
def test_bad_hyper_parameters_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _loss(**kwargs)


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 4),
    num_tokens=st.integers(1, 6),
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
    dual=st.booleans(),
)
def test_padding_never_changes_loss_metrics_or_gradients(num_rows, num_tokens, seed, mode, dual):
    gen = torch.Generator().manual_seed(seed)
    logp, old, ref, adv, ent = (
        torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64) for _ in range(5)
    )
    mask = torch.rand(num_rows, num_tokens, generator=gen) < 0.6

    def run(fill):
        dirty = [torch.where(mask, x, torch.full_like(x, fill)) for x in (logp, old, ref, adv, ent)]
        leaf = dirty[0].clone().requires_grad_(True)
        loss, metrics = algos.ppo_policy_loss(
            logp_BT=leaf,
            old_logp_BT=dirty[1],
            ref_logp_BT=dirty[2],
            adv_BT=dirty[3],
            entropy_BT=dirty[4],
            mask_BT=mask,
            entropy_coef=0.01,
            kl_loss_coef=0.1,
            loss_agg_mode=mode,
            dual_clip_c=3.0 if dual else None,
        )
        loss.backward()
        return loss, metrics, leaf.grad

    clean_loss, clean_metrics, clean_grad = run(0.0)
    for fill in (NAN, 1e6, -1e6):
        loss, metrics, grad = run(fill)
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(grad, clean_grad)
        assert torch.all(grad[~mask] == 0)
        for key, value in clean_metrics.items():
            torch.testing.assert_close(metrics[key], value, equal_nan=True)
