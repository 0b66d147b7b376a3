"""The Triton and CUDA forms of the resharding ops on a GPU, bit for bit against the torch
reference run on the same device. Skipped without CUDA.

Cast inputs hold no NaN: NaN payloads are not part of the contract (torch itself writes different
NaN bits on CPU and GPU).
"""

import pytest
import torch

from rl3d.ops import (
    GatheredShards,
    ParamLayout,
    ShardKind,
    gather_to_layout,
    pack_bucket,
    padded_vocab_size,
    shard_for_tp,
    strided_copy,
    unpack_bucket,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["triton", "cuda"])
def backend(request):
    if request.param == "triton":
        pytest.importorskip("triton")
    else:
        from torch.utils.cpp_extension import CUDA_HOME

        from rl3d.ops import cuda_ext

        if CUDA_HOME is None:
            pytest.skip("no CUDA toolkit to build the extension with")
        assert cuda_ext.available(), "CUDA present but the rl3d extension did not build (see log)"
    return request.param


def bits(tensor):
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device="cuda") * 4).to(dtype)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_strided_copy_with_cast(backend, src_dtype, dst_dtype):
    def zeros(*shape):
        return torch.zeros(*shape, dtype=dst_dtype, device="cuda")

    views = [
        (randn(300, 70, dtype=src_dtype)[:, 3:67], lambda: zeros(300, 90)[:, 5:69]),
        (randn(64, 48, dtype=src_dtype).t(), lambda: zeros(48, 64)),
        (randn(5, 7, 9, 11, dtype=src_dtype).permute(2, 0, 3, 1), lambda: zeros(9, 5, 11, 7)),
        (randn(1 << 20, dtype=src_dtype)[1:-7], lambda: zeros((1 << 20) - 8)),
    ]
    for src, make_dst in views:
        dst, expected = make_dst(), make_dst()
        strided_copy(src, dst, backend=backend)
        strided_copy(src, expected, backend="torch")
        assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_then_unpack(backend, dtype):
    master = [
        randn(1000, 257, seed=1),
        randn(33, seed=2),
        randn(64, 128, seed=3).t(),
        randn(4096, 16, seed=4),
    ]
    bucket = pack_bucket(master, dtype=dtype, backend=backend)
    assert torch.equal(bits(bucket), bits(pack_bucket(master, dtype=dtype, backend="torch")))
    outs = [torch.empty(t.shape, dtype=torch.float32, device="cuda") for t in master]
    expected = [torch.empty_like(out) for out in outs]
    unpack_bucket(bucket, outs, backend=backend)
    unpack_bucket(bucket, expected, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))


CASES = [
    (ParamLayout(kind=ShardKind.QKV, num_heads=64, num_query_groups=8), 8, 2, "hf"),
    (ParamLayout(kind=ShardKind.QKV, num_heads=64, num_query_groups=8), 8, 1, "megatron"),
    (ParamLayout(kind=ShardKind.QKV, num_heads=28, num_query_groups=4), 1, 28, "hf"),
    (ParamLayout(kind=ShardKind.SWIGLU_FC1), 8, 2, "hf"),
    (ParamLayout(kind=ShardKind.SWIGLU_FC1), 4, 1, "megatron"),
    (ParamLayout(kind=ShardKind.ROW), 8, 2, "megatron"),
    (ParamLayout(kind=ShardKind.COLUMN), 4, 2, "megatron"),
    (ParamLayout(kind=ShardKind.VOCAB, vocab_size=32000), 8, 2, "hf"),
]


def full_for(layout, train_tp, dtype):
    hidden = 1024
    if layout.kind is ShardKind.QKV:
        rows = layout.num_query_groups * (layout.heads_per_group + 2) * 128
    elif layout.kind is ShardKind.VOCAB:
        rows = padded_vocab_size(layout.vocab_size, train_tp)
    else:
        rows = 3584 * 2
    return randn(rows, hidden, dtype=dtype, seed=rows)


@pytest.mark.parametrize("layout,train_tp,gen_tp,target", CASES, ids=lambda v: getattr(v, "kind", v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_to_layout(backend, layout, train_tp, gen_tp, target, dtype):
    full = full_for(layout, train_tp, dtype)
    num_shards = max(1, train_tp // gen_tp)
    for gen_rank in range(gen_tp):
        first = gen_rank * train_tp // gen_tp
        shards = [
            shard_for_tp(full, layout.kind, train_tp, r).contiguous()
            for r in range(first, first + num_shards)
        ]
        window = GatheredShards(
            torch.cat([s.reshape(-1) for s in shards]), tuple(shards[0].shape), num_shards
        )
        args = dict(train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target)
        expected = gather_to_layout(shards, layout, backend="torch", **args)
        for source in (shards, window):
            result = gather_to_layout(source, layout, backend=backend, **args)
            if target == "hf":
                assert all(torch.equal(a, b) for a, b in zip(result, expected))
            else:
                assert torch.equal(result, expected)
