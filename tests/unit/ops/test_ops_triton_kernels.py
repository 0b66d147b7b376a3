"""Every Triton kernel, run by Triton's interpreter on the CPU, against the torch reference bit
for bit. TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports triton."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import Case, full_tensor
from ops_strategies import FLOAT_DTYPES, gather_cases, strided_pairs

from rl3d.ops import ParamLayout, ShardKind, gather_to_layout, pack_bucket, strided_copy, unpack_bucket

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton is imported"
)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 vs 0.0 and NaN payloads count as differences."""
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Values where casts go wrong: signed zeros, infinities, subnormals, round-to-even ties and
    values that round up into the next binade or overflow."""
    tie = 1.0 + 2.0**-8  # exactly halfway between two bfloat16 neighbours
    values = [0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3e-39, tie, 1.0 + 3 * 2.0**-8, 65519.0,
              65520.0, 3.4e38, 1.0 - 2.0**-25, 2.0**-24, 5.96e-8]  # fmt: skip
    return torch.tensor(values, dtype=torch.float32).to(dtype)


@settings(max_examples=25, deadline=None)
@given(strided_pairs())
def test_strided_copy_matches_torch(pair):
    src, dst = pair
    expected = dst.clone()
    strided_copy(src, expected, backend="torch")
    strided_copy(src, dst, backend="triton")
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
def test_fused_cast_rounds_like_torch(src_dtype, dst_dtype):
    generator = torch.Generator().manual_seed(1)
    random = torch.randn(3000, generator=generator) * torch.logspace(-20, 20, 3000)
    src = torch.cat([special_values(torch.float32), random]).to(src_dtype)
    packed = pack_bucket([src[:1000], src[1000:].view(-1, 19)], dtype=dst_dtype, backend="triton")
    expected = pack_bucket([src[:1000], src[1000:].view(-1, 19)], dtype=dst_dtype, backend="torch")
    assert torch.equal(bits(packed), bits(expected))


def test_pack_unpack_roundtrip_into_engine_views():
    generator = torch.Generator().manual_seed(2)
    master = [torch.randn(12, 10, generator=generator), torch.randn(7, generator=generator),
              torch.randn(10, 6, generator=generator).t()]  # fmt: skip
    bucket = pack_bucket(master, dtype=torch.bfloat16, out=torch.empty(300, dtype=torch.bfloat16),
                         backend="triton")  # fmt: skip
    assert bucket.numel() == 120 + 7 + 60
    assert torch.equal(bucket, pack_bucket(master, dtype=torch.bfloat16, backend="torch"))
    engine = torch.zeros(12, 30, dtype=torch.float16)
    destinations = [engine[:, 5:15], torch.empty(7, dtype=torch.float16), engine[:10, 20:26].t()]
    unpack_bucket(bucket, destinations, backend="triton")
    for destination, weight in zip(destinations, master):
        assert torch.equal(destination, weight.to(torch.bfloat16).to(torch.float16))
    untouched = [engine[:, :5], engine[:, 15:20], engine[10:, 20:], engine[:, 26:]]
    assert not any(part.any() for part in untouched)


@settings(max_examples=50, deadline=None)
@given(gather_cases(max_tp=4), st.booleans(), st.sampled_from([None, *FLOAT_DTYPES]))
def test_gather_to_layout_matches_torch(case, as_window, out_dtype):
    shards = case.gathered(gap=2, offset=1) if as_window else case.shards()
    args = dict(train_tp=case.train_tp, gen_tp=case.gen_tp, gen_rank=case.gen_rank, target=case.target)
    expected = gather_to_layout(case.shards(), case.layout, backend="torch", **args)
    fused = torch.cat(expected) if case.target == "hf" else expected
    out = None if out_dtype is None else torch.empty(fused.shape, dtype=out_dtype)
    result = gather_to_layout(shards, case.layout, out=out, backend="triton", **args)
    fused_result = torch.cat(result) if case.target == "hf" else result
    assert torch.equal(bits(fused_result), bits(fused.to(fused_result.dtype)))


GQA_CASES = [
    # (heads, query groups, train_tp, gen_tp): MHA, GQA 4:1 and 8:1, replicated KV heads.
    (8, 8, 4, 2),
    (16, 4, 4, 1),
    (32, 4, 2, 2),
    (16, 2, 2, 1),
    (16, 2, 1, 8),
    (16, 4, 2, 8),
]


@pytest.mark.parametrize(
    "heads,groups,train_tp,gen_tp,target",
    # Megatron has no KV-head replication: gen_tp > train_tp only for "hf".
    [
        (*case, target)
        for case in GQA_CASES
        for target in ("megatron", "hf")
        if case[3] <= case[2] or target == "hf"
    ],
)
def test_qkv_across_gqa_ratios(heads, groups, train_tp, gen_tp, target):
    layout = ParamLayout(kind=ShardKind.QKV, num_heads=heads, num_query_groups=groups)
    full = full_tensor(layout, rows_unit=4, cols=16, train_tp=train_tp, dtype=torch.bfloat16, seed=heads)
    for gen_rank in range(gen_tp):
        case = Case(layout, full, train_tp, gen_tp, gen_rank, target)
        args = dict(train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target, backend="triton")
        result = gather_to_layout(case.gathered(), layout, **args)
        assert torch.equal(torch.cat(result) if target == "hf" else result, case.expected())


def test_many_small_tiles(monkeypatch):
    from rl3d.ops import triton_ops

    monkeypatch.setattr(triton_ops, "MAX_TILE", 16)
    layout = ParamLayout(kind=ShardKind.SWIGLU_FC1)
    full = full_tensor(layout, rows_unit=5, cols=13, train_tp=2, dtype=torch.float32)
    case = Case(layout, full, 2, 1, 0, "hf")
    gate, up = gather_to_layout(case.shards(), layout, train_tp=2, gen_tp=1, gen_rank=0, target="hf",
                                backend="triton")  # fmt: skip
    assert torch.equal(gate, full[:10]) and torch.equal(up, full[10:])
