"""Ring attention in one process: the split's positions, CP 1 against plain attention, refusals."""

import pytest
import torch

from rl3d.models.ring_attention import cp_positions, ring_attention


def test_cp_positions_are_megatrons_load_balanced_chunks():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([cp_positions(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    with pytest.raises(AssertionError, match="divisible"):
        cp_positions(10, 4, 0)


def test_without_a_group_it_is_causal_attention_with_gqa():
    gen = torch.Generator().manual_seed(0)
    s, b, np_, ng, hn = 6, 2, 4, 2, 8
    q = torch.randn(s, b, np_, hn, generator=gen)
    k = torch.randn(s, b, ng, hn, generator=gen)
    v = torch.randn(s, b, ng, hn, generator=gen)
    out = ring_attention(q, k, v, None, cp_group=None, softmax_scale=hn**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.repeat_interleave(np_ // ng, 2).permute(1, 2, 0, 3),
        v.repeat_interleave(np_ // ng, 2).permute(1, 2, 0, 3),
        is_causal=True,
    )
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(s, b, np_ * hn), atol=1e-6, rtol=0)


def test_fully_masked_rows_are_uniform_as_in_megatron():
    """A left-padding query whose keys are all masked: megatron's -10000 fill makes its weights
    uniform over all keys, so its output is the mean of the values."""
    s, hn = 4, 2
    q, k, v = torch.randn(s, 1, 1, hn), torch.randn(s, 1, 1, hn), torch.randn(s, 1, 1, hn)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool)
    out = ring_attention(q, k, v, mask, cp_group=None, softmax_scale=1.0)
    torch.testing.assert_close(out[:, 0], v.mean(0).expand(s, 1, hn).reshape(s, hn))
