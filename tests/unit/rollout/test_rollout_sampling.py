"""Sampling semantics against hand-computed distributions, and SamplingParams validation."""

import math

import pytest
import torch

from rl3d.rollout import SamplingParams
from rl3d.rollout.sampling import (
    apply_top_k,
    apply_top_p,
    inverse_cdf,
    sample_generators,
    sample_next,
    sampling_distribution,
)

P = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
LOGITS = P.log().float().unsqueeze(0) + 3.0  # a shift must not matter


def dist(**kw):
    return sampling_distribution(LOGITS, SamplingParams(**kw))[0].double()


def test_temperature_one_is_the_softmax():
    assert torch.allclose(dist(), P, atol=1e-6)


def test_temperature_scales_log_probs():
    # p_T(i) = p_i^(1/T) / sum_j p_j^(1/T)
    for t in (0.5, 2.0):
        expected = P ** (1 / t) / (P ** (1 / t)).sum()
        assert torch.allclose(dist(temperature=t), expected, atol=1e-6)
    assert dist(temperature=0.0).tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy


def test_top_k_renormalises_the_k_best():
    assert torch.allclose(dist(top_k=2), torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(dist(top_k=1), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    assert torch.allclose(dist(top_k=4), P, atol=1e-6) and torch.allclose(dist(top_k=-1), P, atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # mass before each token (sorted): 0, .5, .8, .95 -> kept iff < top_p
    assert torch.allclose(dist(top_p=0.5), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    assert torch.allclose(dist(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64), atol=1e-6)
    expected = torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95
    assert torch.allclose(dist(top_p=0.9), expected, atol=1e-6)
    assert torch.allclose(dist(top_p=0.01), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))


def test_order_is_temperature_then_top_k_then_top_p():
    # T=2: q ∝ sqrt(p) = [.7071, .5477, .3873, .2236] / 1.8657 -> [.379, .294, .208, .120]
    # top_k=3 -> [.7071, .5477, .3873] / 1.6421 = [.4306, .3335, .2359]; top_p=0.7 keeps 2
    q = P.sqrt()[:3]
    q = q / q.sum()
    expected = torch.tensor([q[0], q[1], 0, 0], dtype=torch.float64) / (q[0] + q[1])
    assert torch.allclose(dist(temperature=2.0, top_k=3, top_p=0.7), expected, atol=1e-6)
    assert math.isclose(q[0] + q[1], 0.7641, abs_tol=1e-3)  # 0.43 < 0.7 <= 0.76: exactly 2 kept


def test_filters_keep_ties_and_work_per_row():
    logits = torch.tensor([[1.0, 1.0, 0.0, -1.0], [0.0, 5.0, 0.0, 0.0]])
    assert torch.isinf(apply_top_k(logits, 1)[0]).tolist() == [False, False, True, True]
    assert torch.isinf(apply_top_k(logits, 1)[1]).tolist() == [True, False, True, True]
    # row 0: p = [.3995, .3995, .147, .054]: the second tie has .3995 < .5 before it -> kept
    kept = ~torch.isinf(apply_top_p(logits, 0.5))
    assert kept.tolist() == [[True, True, False, False], [False, True, False, False]]
    kept = ~torch.isinf(apply_top_p(logits, 0.35))
    assert kept.tolist() == [[True, False, False, False], [False, True, False, False]]


def test_inverse_cdf_hits_the_right_bins_and_skips_zeros():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1.0 - 1e-12])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]


def test_empirical_frequencies_match_the_distribution():
    params = SamplingParams(temperature=0.8, top_k=3, seed=0)
    expected = sampling_distribution(LOGITS, params)[0].double()
    draws = 20000
    gens = sample_generators(0, range(draws))
    tokens, logp, raw = sample_next(LOGITS.repeat(draws, 1), params, gens, vocab_size=4)
    freq = torch.bincount(tokens, minlength=4).double() / draws
    # 4 sigma of a binomial proportion at n=20000 is < 0.015
    assert (freq - expected).abs().max().item() < 0.015
    assert freq[3] == 0  # filtered by top_k
    assert torch.allclose(logp.double(), expected.log()[tokens], atol=1e-6)
    assert torch.allclose(raw.double(), P.log()[tokens], atol=1e-6)


def test_padded_vocab_is_never_sampled():
    logits = torch.zeros(64, 8)
    logits[:, 5:] = 50.0  # columns 5.. are vocab padding and would win if not cut
    tokens, _, _ = sample_next(logits, SamplingParams(seed=1), sample_generators(1, range(64)), vocab_size=5)
    assert tokens.max().item() < 5
    greedy, _, _ = sample_next(logits, SamplingParams(temperature=0), [], vocab_size=5)
    assert greedy.max().item() < 5


def test_generators_are_per_sample_and_seeded():
    a = [torch.rand(3, generator=g) for g in sample_generators(7, [0, 1])]
    b = [torch.rand(3, generator=g) for g in sample_generators(7, [1])]
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    c = torch.rand(3, generator=sample_generators(8, [0])[0])
    assert not torch.equal(a[0], c)


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(n=0), "n"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[1, -3]), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kw, key):
    with pytest.raises(ValueError, match=f"SamplingParams.{key}"):
        SamplingParams(**kw)


def test_sampling_params_normalises():
    p = SamplingParams(stop_token_ids=[2, 3], top_k=-1)
    assert p.stop_token_ids == (2, 3) and p.top_k == 0 and hash(p)
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword-only
