"""GSPO, GMPO, SAPO, CISPO, GPG: hand-computed values on tiny inputs, and gradients by autograd
against a direct implementation of each paper's formula on random inputs (float64, 1e-10)."""

import math

import pytest
import torch

from rl3d import algos

SEQ = "seq-mean-token-mean"
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _run(fn, ratios, adv, mask, **kwargs):
    logp = torch.log(torch.as_tensor(ratios, dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros_like(logp)
    loss, metrics = fn(
        logp_BT=logp,
        old_logp_BT=old,
        adv_BT=torch.as_tensor(adv, dtype=torch.float64),
        mask_BT=mask,
        **kwargs,
    )
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_gspo_by_hand():
    # Row 0: log ratios ln 1.1, ln 1.1 -> s = 1.1 past 1 + 4e-4 with A = 1: clipped at 1.0004.
    # Row 1: s = exp((ln 1.0001 + ln 1.0001 + ln 1.0001) / 3) = 1.0001, inside the range, A = -2.
    ratios = [[1.1, 1.1, 1.0], [1.0001, 1.0001, 1.0001]]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    loss, metrics, grad = _run(algos.gspo_policy_loss, ratios, [[1.0, 1.0, 0.0], [-2.0] * 3], mask)
    assert loss == pytest.approx((-1.0004 + 2 * 1.0001) / 2, rel=1e-12)
    assert metrics["seq_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["seq_ratio_max"].item() == pytest.approx(1.1)
    assert metrics["seq_ratio_min"].item() == pytest.approx(1.0001)
    # Clipped row: no gradient. Row 1: d/dlogp_t of -A s / 1 (seq mean) = 2 * s / 3 / 2 sequences.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [1.0001 / 3] * 3], dtype=torch.float64))


def test_gmpo_by_hand():
    # Row 0, A = 1: log ratios 0.5 (clipped to 0.4 upwards) and -0.2: exp((0.4 - 0.2) / 2) = e^0.1.
    # Row 1, A = -1: log ratios -0.6 (clipped to -0.4 downwards) and 0.6 (kept: not the A<0 side).
    ratios = torch.exp(torch.tensor([[0.5, -0.2], [-0.6, 0.6]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics, grad = _run(algos.gmpo_policy_loss, ratios, [[1.0, 1.0], [-1.0, -1.0]], mask)
    assert loss == pytest.approx((-math.exp(0.1) + math.exp(0.1)) / 2, abs=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    # d/dl of -A exp(mean l) = -A e^0.1 / 2 per unclipped token, then / 2 sequences.
    want = torch.tensor([[0.0, -math.exp(0.1) / 4], [0.0, math.exp(0.1) / 4]], dtype=torch.float64)
    torch.testing.assert_close(grad, want)


def test_sapo_by_hand():
    # r = 1: f = 4/tau * 1/2 = 2/tau; gradient weight 4 * 1/4 = 1, the plain policy gradient.
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics, grad = _run(algos.sapo_policy_loss, [[1.0, 1.0]], [[1.0, -1.0]], mask)
    assert loss == pytest.approx((-2.0 / 1.0 + 2.0 / 1.05) / 2)
    assert metrics["gate_weight_mean"].item() == pytest.approx(1.0)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]], dtype=torch.float64))
    # r = 2, A = 1, tau = 1: f = 4 sigmoid(1); df/dlog r = 4 s (1 - s) r.
    s = 1 / (1 + math.exp(-1))
    loss, _, grad = _run(algos.sapo_policy_loss, [[2.0]], [[1.0]], torch.ones(1, 1, dtype=torch.bool))
    assert loss == pytest.approx(-4 * s)
    assert grad.item() == pytest.approx(-4 * s * (1 - s) * 2)


def test_cispo_by_hand():
    # Weights clip(r, 0, 1.28), detached: r = 2 -> 1.28 (truncated, yet it keeps its gradient).
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics, grad = _run(algos.cispo_policy_loss, [[2.0, 0.5, 1.0]], [[1.0, -1.0, 2.0]], mask)
    want = -(1.28 * 1.0 * math.log(2.0) + 0.5 * -1.0 * math.log(0.5) + 0.0) / 3
    assert loss == pytest.approx(want)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["is_weight_mean"].item() == pytest.approx((1.28 + 0.5 + 1.0) / 3)
    torch.testing.assert_close(grad, torch.tensor([[-1.28, 0.5, -2.0]], dtype=torch.float64) / 3)


def test_gpg_by_hand():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, _, grad = _run(algos.gpg_policy_loss, [[0.5, 0.25, 1.0]], [[2.0, -1.0, 9.0]], mask)
    assert loss == pytest.approx(-(2.0 * math.log(0.5) - math.log(0.25)) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5, 0.0]], dtype=torch.float64))


# Direct implementations of each paper's formula, per sequence, without rl3d's helpers.


def _gspo_direct(logp, old, adv, mask, lo=3e-4, hi=4e-4):
    total = 0
    for i in range(logp.shape[0]):
        m = mask[i]
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        total = total + torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a)
    return -total / logp.shape[0]


def _gmpo_direct(logp, old, adv, mask, eps=0.4):
    total = 0
    for i in range(logp.shape[0]):
        m = mask[i]
        a = adv[i][m][0]
        r = torch.exp(logp[i][m] - old[i][m])
        terms = torch.minimum(r * a, r.clamp(math.exp(-eps), math.exp(eps)) * a)
        total = total + torch.sign(a) * torch.prod(torch.abs(terms)) ** (1.0 / int(m.sum()))
    return -total / logp.shape[0]


def _sapo_direct(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    r = torch.exp(logp - old)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    f = torch.sigmoid(tau * (r - 1)) * 4 / tau
    per_seq = [(f[i][mask[i]] * adv[i][mask[i]]).mean() for i in range(logp.shape[0])]
    return -sum(per_seq) / logp.shape[0]


def _cispo_direct(logp, old, adv, mask, hi=0.28):
    w = torch.exp(logp - old).clamp(0, 1 + hi).detach()
    return -(w * adv * logp)[mask].sum() / mask.sum()


def _gpg_direct(logp, old, adv, mask):
    return -(adv * logp)[mask].sum() / mask.sum()


@pytest.mark.parametrize(
    ("name", "direct", "agg"),
    [
        ("gspo", _gspo_direct, SEQ),
        ("gmpo", _gmpo_direct, SEQ),
        ("sapo", _sapo_direct, SEQ),
        ("cispo", _cispo_direct, "token-mean"),
        ("gpg", _gpg_direct, "token-mean"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_the_papers_formula(name, direct, agg, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = 5, 7
    logp = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.5 - 1.0).requires_grad_(True)
    scale = 0.3 if name in ("gmpo", "sapo", "cispo") else 2e-4  # GSPO's range is 1e-4 wide
    old = logp.detach() + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, cols).clone()
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    loss, _ = algos.get_policy_loss(name)(
        logp_BT=logp, old_logp_BT=old, adv_BT=adv, mask_BT=mask, loss_agg_mode=agg
    )
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    want = direct(logp2, old, adv, mask)
    (want_grad,) = torch.autograd.grad(want, logp2)
    torch.testing.assert_close(loss, want.to(loss.dtype), **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
