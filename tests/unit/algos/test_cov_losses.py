"""Clip-Cov and KL-Cov: which tokens each selects, by hand, and their value and gradient
against a direct implementation of the paper's formula (float64, 1e-10)."""

import math

import pytest
import torch

from rl3d import algos

TOL = {"rtol": 1e-10, "atol": 1e-12}


def _inputs():
    # Token 0: high logp and high advantage, the one large covariance; the others near the means.
    logp = torch.tensor([[-0.1, -3.0, -3.0, -3.0, -3.0]], dtype=torch.float64)
    adv = torch.tensor([[4.0, -1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    return logp, adv, torch.ones(1, 5, dtype=torch.bool)


def test_covariance_by_hand():
    logp, adv, mask = _inputs()
    # means: logp -2.42, adv 0.0 -> cov_0 = 4 * 2.32 = 9.28, cov_t = -1 * -0.58 = 0.58 for the rest
    _, metrics = algos.kl_cov_policy_loss(logp_BT=logp, old_logp_BT=logp, adv_BT=adv, mask_BT=mask)
    assert metrics["cov_mean"].item() == pytest.approx((9.28 + 4 * 0.58) / 5)


def test_kl_cov_penalises_the_top_covariance_token():
    logp, adv, mask = _inputs()
    old = logp - torch.tensor([[0.5, 0.1, -0.1, 0.2, 0.0]], dtype=torch.float64)
    logp = logp.clone().requires_grad_(True)
    loss, metrics = algos.kl_cov_policy_loss(logp_BT=logp, old_logp_BT=old, adv_BT=adv, mask_BT=mask)
    r = [math.exp(x) for x in (0.5, 0.1, -0.1, 0.2, 0.0)]
    a = [4.0, -1.0, -1.0, -1.0, -1.0]
    want = (sum(-ai * ri for ai, ri in zip(a, r)) + 1.0 * 0.5) / 5  # |log r| = 0.5 on token 0 only
    assert loss.item() == pytest.approx(want)
    assert metrics["kl_cov_frac"].item() == pytest.approx(0.2)
    assert metrics["kl_cov_penalty"].item() == pytest.approx(0.5)
    loss.backward()
    want_grad = [(-ai * ri) / 5 for ai, ri in zip(a, r)]
    want_grad[0] += 1.0 / 5
    torch.testing.assert_close(logp.grad, torch.tensor([want_grad], dtype=torch.float64))


def test_clip_cov_detaches_only_a_token_in_the_band():
    logp, adv, mask = _inputs()
    # Token 0's covariance 9.28 is past cov_ub 5: no token is in (1, 5) -> nothing detached.
    logp_ = logp.clone().requires_grad_(True)
    loss, metrics = algos.clip_cov_policy_loss(logp_BT=logp_, old_logp_BT=logp, adv_BT=adv, mask_BT=mask)
    assert metrics["cov_clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp_.grad, -adv / 5)
    # A band holding token 0 only: its gradient goes, its value stays, the others keep theirs.
    logp_ = logp.clone().requires_grad_(True)
    loss2, metrics = algos.clip_cov_policy_loss(
        logp_BT=logp_, old_logp_BT=logp, adv_BT=adv, mask_BT=mask, cov_lb=5.0, cov_ub=10.0
    )
    assert metrics["cov_clipfrac"].item() == pytest.approx(0.2)
    assert loss2.item() == pytest.approx(loss.item())
    loss2.backward()
    torch.testing.assert_close(logp_.grad, torch.tensor([[0.0, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64))


def test_clip_cov_never_picks_a_token_the_ppo_clip_already_holds():
    logp, adv, mask = _inputs()
    old = logp - torch.tensor([[0.5, 0, 0, 0, 0]], dtype=torch.float64)  # r_0 = e^0.5 > 1.2, A > 0
    _, metrics = algos.clip_cov_policy_loss(
        logp_BT=logp, old_logp_BT=old, adv_BT=adv, mask_BT=mask, cov_lb=5.0, cov_ub=10.0
    )
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.2)
    assert metrics["cov_clipfrac"].item() == 0.0


def _kl_cov_direct(logp, old, adv, mask, k=2e-3, coef=1.0):
    lp, a = logp.detach()[mask], adv[mask]
    cov = (a - a.mean()) * (lp - lp.mean())
    num = max(int(k * len(cov)), 1)
    top = set(torch.topk(cov, num).indices.tolist())
    log_r = (logp - old)[mask]
    terms = [
        -a[j] * torch.exp(log_r[j]) + (coef * log_r[j].abs() if j in top else 0) for j in range(len(cov))
    ]
    return sum(terms) / len(terms)


def _clip_cov_direct(logp, old, adv, mask, detached, eps=0.2):
    r = torch.exp(logp - old)
    surrogate = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps))
    surrogate = torch.where(detached, surrogate.detach(), surrogate)
    return surrogate[mask].sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_the_papers_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(6, 9, generator=gen, dtype=torch.float64) - 1.0).requires_grad_(True)
    old = logp.detach() + torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 9).clone() * 3
    mask = torch.arange(9)[None, :] < torch.randint(1, 10, (6,), generator=gen)[:, None]
    kwargs = {"logp_BT": logp, "old_logp_BT": old, "adv_BT": adv, "mask_BT": mask}
    loss, _ = algos.kl_cov_policy_loss(**kwargs, cov_ratio=0.1)
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    want = _kl_cov_direct(logp2, old, adv, mask, k=0.1)
    torch.testing.assert_close(loss, want, **TOL)
    torch.testing.assert_close(grad, torch.autograd.grad(want, logp2)[0], **TOL)
    # Clip-Cov draws at random: the direct form is given the tokens it detached (no gradient).
    torch.manual_seed(seed)
    loss, metrics = algos.clip_cov_policy_loss(**kwargs, cov_ratio=0.1, cov_lb=-1e9, cov_ub=1e9)
    (grad,) = torch.autograd.grad(loss, logp)
    r = torch.exp(logp.detach() - old)
    in_clip = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    detached = mask & ~in_clip & (grad == 0)
    assert int(detached.sum()) == max(int(0.1 * int(mask.sum())), 1)
    assert metrics["cov_clipfrac"].item() == pytest.approx(int(detached.sum()) / int(mask.sum()))
    logp2 = logp.detach().clone().requires_grad_(True)
    want = _clip_cov_direct(logp2, old, adv, mask, detached)
    torch.testing.assert_close(loss, want, **TOL)
    torch.testing.assert_close(grad, torch.autograd.grad(want, logp2)[0], **TOL)
