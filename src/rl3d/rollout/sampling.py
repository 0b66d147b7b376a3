"""Next-token sampling: temperature, top-k, top-p, seeded draws (pure functions on tensors).

The order is the one vLLM and SGLang use: scale the logits by 1/temperature, keep the top-k
logits, then keep the nucleus of the renormalised distribution. The sampled token's log-prob is
taken from that final (filtered, renormalised) distribution, so it is the probability of the
draw that actually happened.

- top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
- top-p keeps a token iff the mass of the tokens ranked strictly before it is < top_p, so the
  most likely token is always kept and the kept set is the smallest prefix reaching top_p;
- draws are by inverse CDF with one uniform per row from that row's own `torch.Generator`, so a
  sample's tokens depend only on its seed and its logits, not on the batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl3d.rollout.base import SamplingParams

NEG_INF = float("-inf")


def apply_top_k(logits_BV: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits_BV.shape[-1]:
        return logits_BV
    kth = torch.topk(logits_BV, top_k, dim=-1).values[..., -1:]
    return logits_BV.masked_fill(logits_BV < kth, NEG_INF)


def apply_top_p(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits_BV
    sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits_BV.masked_fill(drop, NEG_INF)


def processed_logits(logits_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits of the sampling distribution (-inf where filtered out); not for greedy."""
    assert not params.greedy, "greedy decoding has no sampling distribution to filter"
    z = logits_BV.float() / params.temperature
    return apply_top_p(apply_top_k(z, params.top_k), params.top_p)


def sampling_distribution(logits_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] probabilities the sampler draws from (one-hot at the argmax for greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits_BV.argmax(-1), logits_BV.shape[-1]).float()
    return torch.softmax(processed_logits(logits_BV, params), dim=-1)


def draw_uniforms(
    generators: Sequence[torch.Generator], device: torch.device, steps: int = 0
) -> torch.Tensor:
    """One U[0, 1) per row, each from that row's generator (CPU generators, moved to `device`).
    With `steps` > 0: [B, steps], the uniforms of that many successive draws (a CPU generator
    fills a tensor serially, so row i equals `steps` one-at-a-time draws from generator i)."""
    if steps:
        u = torch.stack([torch.rand(steps, generator=g, dtype=torch.float64) for g in generators])
    else:
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    return u.to(device)


def inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Token ids drawn from `probs_BV` (rows need not sum to 1) with uniforms `u_B`; never a
    zero-probability token."""
    cdf = torch.cumsum(probs_BV.double(), dim=-1)
    target = (u_B.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    vocab = probs_BV.shape[-1]
    last_positive = (vocab - 1) - (probs_BV > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_positive)


def sample_next(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    generators: Sequence[torch.Generator],
    vocab_size: int,
    uniforms_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row from (padded-vocab) logits, with `uniforms_B` (drawn ahead by
    `draw_uniforms(..., steps)`) or else one fresh draw from each row's generator.

    Returns (tokens [B] int64, log-prob under the sampling distribution [B] fp32 (0 for greedy),
    log-prob under the plain temperature-1 softmax [B] fp32). Columns >= `vocab_size` (Megatron's
    vocab padding) are never sampled."""
    z = logits_BV if logits_BV.shape[-1] == vocab_size else logits_BV[:, :vocab_size]
    z = z if z.dtype == torch.float32 else z.float()  # skip no-op dispatches: this runs every step
    raw_logp = torch.log_softmax(z, dim=-1)
    if params.greedy:
        tokens = z.argmax(-1)
        logp = torch.zeros(tokens.shape, dtype=torch.float32, device=z.device)
    else:
        final_logp = torch.log_softmax(processed_logits(z, params), dim=-1)
        u = draw_uniforms(generators, z.device) if uniforms_B is None else uniforms_B
        tokens = inverse_cdf(final_logp.exp(), u)
        logp = final_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    raw = raw_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logp, raw


def top_logprobs(logits_BV: torch.Tensor, vocab_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each row under the plain (temperature-1) softmax, most
    likely first: (log-probs [B, k] fp32, token ids [B, k] int64). The same softmax as
    `sample_next`'s raw log-prob, so a sampled token in the top k has the very same value."""
    z = logits_BV if logits_BV.shape[-1] == vocab_size else logits_BV[:, :vocab_size]
    z = z if z.dtype == torch.float32 else z.float()
    return torch.log_softmax(z, dim=-1).topk(min(k, vocab_size), dim=-1)


def sample_generators(base_seed: int, sample_ids: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample, seeded from (base seed, global sample index)."""
    mask = (1 << 63) - 1
    return [
        torch.Generator().manual_seed((base_seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019 * (i + 1)) & mask)
        for i in sample_ids
    ]
