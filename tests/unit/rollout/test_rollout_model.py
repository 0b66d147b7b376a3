"""The torch engine's per-step shortcuts give bit-identical values to the plain computation."""

import pytest
import torch

from rl3d.rollout.model import additive_mask, causal_mask
from rl3d.rollout.rope import RopeTable, apply_rope, rope_cos_sin
from rl3d.rollout.sampling import draw_uniforms, sample_generators


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_equals_per_step_rope(dtype):
    head_dim, theta = 16, 1e6
    table = RopeTable(300, head_dim, theta, dtype, "cpu")
    positions = torch.tensor([[0, 1, 5, 17], [299, 3, 128, 64], [7, 7, 7, 250]])
    cos, sin = rope_cos_sin(positions, head_dim, theta, dtype)  # [B, 1, T, D]
    x = torch.randn(3, 4, 2, 3, head_dim).to(dtype)  # [B, T, groups, heads, D]
    t_cos, t_sin = table.gather(positions)
    expected = x * cos[:, 0, :, None, None] + rotate_half(x) * sin[:, 0, :, None, None]
    assert torch.equal(t_cos[:, :, 0, 0], cos[:, 0])
    assert torch.equal(apply_rope(x, t_cos, t_sin), expected)


def test_decode_mask_view_equals_causal_mask():
    key_valid = torch.zeros(3, 12, dtype=torch.bool)
    key_valid[:, :6] = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    bias = additive_mask(key_valid, torch.float32)
    for slot in range(6, 12):  # one new token per step, each sees itself
        key_valid[:, slot] = True
        bias[:, slot] = 0.0
        assert torch.equal(
            bias[:, None, None, : slot + 1], causal_mask(key_valid, slot, slot + 1, torch.float32)
        )
    prefill = causal_mask(key_valid, 0, 6, torch.float32)
    assert prefill.shape == (3, 1, 6, 6) and (prefill[2, 0, :5].diagonal() == 0).all()  # padding sees itself


def test_uniforms_drawn_ahead_equal_one_draw_per_step():
    ahead = draw_uniforms(sample_generators(7, range(5)), torch.device("cpu"), steps=33)
    gens = sample_generators(7, range(5))
    per_step = torch.stack([draw_uniforms(gens, torch.device("cpu")) for _ in range(33)], dim=1)
    assert ahead.shape == (5, 33) and torch.equal(ahead, per_step)
