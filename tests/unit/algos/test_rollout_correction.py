"""Rollout-training mismatch correction: each mode's weights by hand, the loss they scale, and an
injected bf16-vs-fp32 mismatch whose corrected policy gradient is the exact on-policy one."""

import math

import pytest
import torch

from rl3d.algos import policy_loss_of, ppo_policy_loss
from rl3d.algos.rollout_correction import rollout_weights
from rl3d.config import AlgorithmConfig
from rl3d.config.schema import RolloutCorrectionConfig

LOG2, LOG3 = math.log(2.0), math.log(3.0)
# two sequences of three tokens; the second's last token is padding. old - rollout log-ratios:
OLD = torch.tensor([[0.0, LOG3, -LOG3], [0.5 * LOG2, LOG2, 9.0]])
ROLLOUT = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def weights(mode, threshold=2.0):
    return rollout_weights(OLD, ROLLOUT, MASK, mode=mode, threshold=threshold)


def test_tis_truncates_each_token_ratio_at_the_threshold():
    w, keep, m = weights("tis")
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 1 / 3], [2**0.5, 2.0, 0.0]]))
    assert keep.equal(MASK)
    assert m["clipped_frac"].item() == pytest.approx(1 / 5)  # the ratio 3
    assert m["weight_max"].item() == pytest.approx(2.0)
    assert m["weight_mean"].item() == pytest.approx((1 + 2 + 1 / 3 + 2**0.5 + 2) / 5)


def test_mis_masks_tokens_whose_ratio_leaves_the_band():
    w, keep, m = weights("mis")
    assert keep.tolist() == [[True, False, False], [True, True, False]]  # 3 and 1/3 leave [1/2, 2]
    torch.testing.assert_close(w, keep.float())
    assert m["masked_frac"].item() == pytest.approx(2 / 5)


def test_seq_tis_weights_a_whole_sequence_by_its_product_ratio():
    w, _, m = weights("seq_tis", threshold=4.0)
    # products: 1 * 3 * 1/3 = 1; sqrt(2) * 2 = 2.83 (the padded token's ratio is left out)
    torch.testing.assert_close(w, torch.tensor([[1.0] * 3, [2 * 2**0.5] * 2 + [0.0]]))
    assert m["clipped_frac"].item() == 0.0
    w, _, m = weights("seq_tis", threshold=2.0)
    torch.testing.assert_close(w[1, :2], torch.tensor([2.0, 2.0]))
    assert m["clipped_frac"].item() == pytest.approx(2 / 5)


def test_kl_k3_between_rollout_and_trainer():
    _, _, m = weights("none")
    k3 = [math.exp(d) - d - 1 for d in (0.0, LOG3, -LOG3, 0.5 * LOG2, LOG2)]
    assert m["kl_k3"].item() == pytest.approx(sum(k3) / 5, rel=1e-6)


def test_the_correction_scales_the_surrogate_under_every_preset():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 3, generator=gen) * 0.1 + OLD
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 1.5, 0.0]])
    for preset in ("ppo", "dual_clip", "clip_higher"):
        cfg = AlgorithmConfig(policy_loss=preset, rollout_correction=RolloutCorrectionConfig(mode="tis"))
        loss, metrics = policy_loss_of(cfg)(
            logp_BT=logp, old_logp_BT=OLD, adv_BT=adv, mask_BT=MASK, rollout_logp_BT=ROLLOUT
        )
        expected, _ = policy_loss_of(AlgorithmConfig(policy_loss=preset))(
            logp_BT=logp, old_logp_BT=OLD, adv_BT=adv, mask_BT=MASK, weights_BT=weights("tis")[0]
        )
        assert torch.equal(loss, expected)
        assert {"rollout/kl_k3", "rollout_corr/weight_mean", "rollout_corr/clipped_frac"} <= set(metrics)


def _policy_gradient(logits_V, adv_V, sample_probs_V, weights_V=None):
    """d/dlogits of the PPO loss at ratio 1 over every token y, each weighted by the probability
    the samples have of it: the expected gradient of a batch drawn from `sample_probs_V`."""
    logits = logits_V.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    V = logits_V.shape[0]
    loss, _ = ppo_policy_loss(
        logp_BT=logp[:, None],
        old_logp_BT=logp.detach()[:, None],
        adv_BT=(V * sample_probs_V * adv_V)[:, None],  # token-mean over V rows: an expectation
        mask_BT=torch.ones(V, 1, dtype=torch.bool),
        weights_BT=None if weights_V is None else weights_V[:, None],
    )
    (-loss).backward()
    return logits.grad


def test_injected_bf16_mismatch_tis_recovers_the_on_policy_gradient():
    """The trainer's policy in fp32, the rollout engine's the same logits in bf16 (as a bf16
    engine computes them). Expected gradients, exact (every token weighted by its probability):
    the uncorrected one uses the rollout distribution, the TIS one reweights it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=gen) * 6.0
    adv = torch.randn(64, generator=gen)
    trainer_p = torch.softmax(logits, -1)
    rollout_p = torch.softmax(logits.to(torch.bfloat16).float(), -1)
    exact = _policy_gradient(logits, adv, trainer_p)
    uncorrected = _policy_gradient(logits, adv, rollout_p)
    w, _, _ = rollout_weights(
        trainer_p.log()[:, None],
        rollout_p.log()[:, None],
        torch.ones(64, 1, dtype=torch.bool),
        mode="tis",
        threshold=2.0,
    )
    corrected = _policy_gradient(logits, adv, rollout_p, w[:, 0])
    cos = torch.nn.functional.cosine_similarity
    cos_u, cos_c = cos(uncorrected, exact, dim=0).item(), cos(corrected, exact, dim=0).item()
    err_u, err_c = (uncorrected - exact).norm().item(), (corrected - exact).norm().item()
    print(f"cosine to exact: uncorrected {cos_u:.6f}, tis {cos_c:.6f}; error norm {err_u:.3e} vs {err_c:.3e}")  # noqa: T201
    assert (trainer_p / rollout_p).max() < 2.0  # no truncation: TIS is unbiased here
    assert err_c < 1e-3 * err_u and cos_c > cos_u
