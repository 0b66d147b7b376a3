"""Ring attention over a CP group against full attention at CP 1, fp32, on gloo.

Each rank builds the same full-sequence query, key and value (GQA: 4 query heads over 2 key-value
groups), computes megatron's local attention arithmetic over the whole sequence (scale, masked
scores filled with -10000, softmax, weighted sum), then ring attention over its CP part
(megatron's load-balanced split: chunks r and 2 * cp - 1 - r). The rank's output rows and its
gradients of query, key and value (from the same weighted sum of the output) equal the full
attention's rows within 1e-6: causal without a mask, causal with left padding given as the full
[b, 1, s, s] mask, and as the mask cut to this rank's rows (megatron's `get_batch_on_this_cp_rank`),
and a packed row as rl3d runs it on the local spec (a block-causal mask; the row split as one
sequence, not megatron's per-sequence THD split).
Not bit for bit: the softmax's sum is split over ring steps and merged by log-sum-exp.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

S, B, NP, NG, HN = 16, 3, 4, 2, 8
TOL = 1e-6
PAD = (0, 5, 11)  # left-padding per sample; 11 > a CP 4 chunk of 2, so whole chunks are padding
PACKED_BOUNDS = (0, 5, 12, 16)  # sequences of 5, 7 and 4 tokens


def inputs(seed=7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, NP, HN, generator=gen, dtype=torch.float64).float()
    k = torch.randn(S, B, NG, HN, generator=gen, dtype=torch.float64).float()
    v = torch.randn(S, B, NG, HN, generator=gen, dtype=torch.float64).float()
    w = torch.randn(S, B, NP * HN, generator=gen, dtype=torch.float64).float()
    return q, k, v, w


def padded_causal_mask():
    """megatron's [b, 1, s, s] bool mask, True = masked: future keys and left-padding keys."""
    pos = torch.arange(S)
    causal = pos[None, :] > pos[:, None]
    pad = pos[None, :] < torch.tensor(PAD)[:, None]  # [b, s]
    return (causal[None] | pad[:, None, :])[:, None]


def packed_mask():
    """rl3d's packed row on the local spec: a block-causal [1, 1, s, s] mask over three sequences
    whose bounds fall inside CP chunks."""
    from rl3d.models.packing import block_causal_mask

    return block_causal_mask(torch.tensor(PACKED_BOUNDS), S)


def full_attention(q, k, v, mask, scale):
    """megatron's local DotProductAttention arithmetic on the whole sequence."""
    k = k.repeat_interleave(NP // NG, dim=2)
    v = v.repeat_interleave(NP // NG, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    if mask is None:
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
    return torch.einsum("bnqk,kbnd->qbnd", probs, v).reshape(S, B, NP * HN)


def worker(rank, world, mask_kind):
    import torch.distributed as dist

    from rl3d.models.ring_attention import cp_positions, ring_attention

    scale = HN**-0.5
    q, k, v, w = inputs()
    mask = {"causal": None, "packed": packed_mask()}.get(mask_kind, padded_causal_mask())
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full = full_attention(*full, mask, scale)
    (out_full * w).sum().backward()

    pos = cp_positions(S, world, rank)
    local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
    local_mask = mask[:, :, pos] if mask_kind == "padded_rows" else mask
    out = ring_attention(*local, local_mask, cp_group=dist.group.WORLD, softmax_scale=scale)
    (out * w[pos]).sum().backward()
    diffs = {"out": (out - out_full[pos]).abs().max().item()}
    for name, mine, ref in zip("qkv", local, full, strict=True):
        diffs[f"grad_{name}"] = (mine.grad - ref.grad[pos]).abs().max().item()
    return diffs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask_kind", ["causal", "padded_full", "padded_rows", "packed"])
def test_ring_attention_equals_full_attention(cp, mask_kind):
    results = run_distributed(worker, cp, mask_kind)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    print(f"cp={cp} {mask_kind}: {worst}")
    assert all(d <= TOL for d in worst.values()), worst
