"""The view plan the Triton and CUDA forms share, executed block by block with torch: many cheap
examples here, so the interpreter tests can stay few."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_strategies import gather_cases, strided_pairs

from rl3d.ops import gather_to_layout, output_shape, pack_bucket
from rl3d.ops.views import CopyBlock, coalesce, copy_blocks, gather_blocks, pack_blocks, unpack_blocks


def run_with_torch(blocks: list[CopyBlock]) -> None:
    for block in blocks:
        assert len(block.sizes) == 3
        source = block.src.as_strided(block.sizes, block.src_strides)
        block.dst.as_strided(block.sizes, block.dst_strides).copy_(source)


def test_coalesce_merges_contiguous_runs_and_drops_unit_dims():
    assert coalesce((2, 3, 4), (12, 4, 1), (12, 4, 1)) == ([24], [1], [1])
    assert coalesce((2, 1, 4), (40, 7, 1), (4, 99, 1)) == ([2, 4], [40, 1], [4, 1])
    assert coalesce((3, 4), (1, 3), (4, 1)) == ([3, 4], [1, 3], [4, 1])


def test_more_than_three_unmergeable_dims_split_into_three_dim_blocks():
    src = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5).permute(3, 1, 0, 2)
    dst = torch.empty(3, 5, 4, 2).permute(1, 0, 3, 2)
    blocks = copy_blocks(src, dst)
    assert len(blocks) == 5
    run_with_torch(blocks)
    assert torch.equal(dst, src)


@settings(max_examples=300, deadline=None)
@given(strided_pairs())
def test_copy_blocks_reproduce_copy(pair):
    src, dst = pair
    expected = dst.clone().copy_(src)
    run_with_torch(copy_blocks(src, dst))
    assert torch.equal(dst, expected)


@settings(max_examples=400, deadline=None)
@given(gather_cases(), st.booleans(), st.booleans())
def test_gather_blocks_reproduce_the_reference(case, as_window, strided_out):
    shards = case.gathered(gap=3, offset=2) if as_window else case.shards()
    shape = output_shape(case.layout, tuple(case.shards()[0].shape), case.num_shards, case.train_tp,
                         case.gen_tp, case.gen_rank, case.target)  # fmt: skip
    host = torch.full((shape[0] + 2, *shape[1:]), -1.0, dtype=case.full.dtype)
    out = host[1:-1] if strided_out else torch.full(shape, -1.0, dtype=case.full.dtype)
    args = dict(train_tp=case.train_tp, gen_tp=case.gen_tp, gen_rank=case.gen_rank, target=case.target)
    run_with_torch(gather_blocks(shards, case.layout, out=out, **args))
    reference = gather_to_layout(case.shards(), case.layout, backend="torch", **args)
    fused = torch.cat(reference) if case.target == "hf" else reference
    assert torch.equal(out, fused)
    assert torch.equal(fused, case.expected())
    if strided_out:
        assert (host[0] == -1).all() and (host[-1] == -1).all()


def test_pack_and_unpack_blocks_roundtrip():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 3).t()]
    bucket = torch.empty(12 + 5 + 6)
    run_with_torch(pack_blocks(tensors, bucket))
    assert torch.equal(bucket, pack_bucket(tensors, backend="torch"))
    outs = [torch.empty(3, 4), torch.empty(5), torch.empty(2, 3).t()]
    run_with_torch(unpack_blocks(bucket, outs))
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))
