"""Hypothesis strategies for the resharding-kernel tests: small but varied parameters."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from ops_cases import Case, full_tensor

from rl3d.ops import ParamLayout, ShardKind

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def gather_cases(draw, max_tp: int = 8) -> Case:
    """A parameter kind, model dims, (train_tp, gen_tp, gen_rank) and target that rl3d can meet,
    GQA ratios and KV-head replication included."""
    kind = draw(st.sampled_from(list(ShardKind)))
    target = draw(st.sampled_from(["megatron", "hf"]))
    train_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= max_tp]))
    gen_tp = draw(st.sampled_from([g for g in (1, 2, 4, 8) if train_tp % g == 0]))
    cols = draw(st.sampled_from([0, 1, 3, 8, 24]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    if kind is ShardKind.QKV:
        groups = train_tp * draw(st.sampled_from([1, 2]))
        heads = groups * draw(st.sampled_from([1, 2, 4]))
        if target == "hf" and draw(st.booleans()):
            # KV-head replication: one coarser shard, finer generation TP.
            gen_tp = groups * draw(st.sampled_from([1, 2, 4]))
            gen_tp = gen_tp if heads % gen_tp == 0 else groups
            if gen_tp > train_tp:
                layout = ParamLayout(kind=kind, num_heads=heads, num_query_groups=groups)
                full = full_tensor(layout, rows_unit=draw(st.sampled_from([1, 2, 4])), cols=cols,
                                   train_tp=train_tp, dtype=dtype)  # fmt: skip
                return Case(layout, full, train_tp, gen_tp, draw(st.integers(0, gen_tp - 1)), target)
        layout = ParamLayout(kind=kind, num_heads=heads, num_query_groups=groups)
        rows_unit = draw(st.sampled_from([1, 2, 4]))
    elif kind is ShardKind.VOCAB:
        layout = ParamLayout(kind=kind, vocab_size=draw(st.integers(1, 200)))
        rows_unit = draw(st.sampled_from([4, 8, 16]))
    else:
        layout = ParamLayout(kind=kind)
        rows_unit = draw(st.sampled_from([1, 2, 5, 8]))
    if kind is ShardKind.ROW:
        cols = max(cols, 1)
    full = full_tensor(layout, rows_unit=rows_unit, cols=cols, train_tp=train_tp, dtype=dtype)
    return Case(layout, full, train_tp, gen_tp, draw(st.integers(0, gen_tp - 1)), target)


@st.composite
def strided_pairs(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) views of equal shape with arbitrary strides: slices with steps, transposes and
    storage offsets, the way engine parameters are sliced."""
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]

    def view(dtype: torch.dtype, seed: int) -> torch.Tensor:
        steps = [draw(st.integers(1, 3)) for _ in shape]
        starts = [draw(st.integers(0, 2)) for _ in shape]
        base_shape = [start + size * step for start, size, step in zip(starts, shape, steps)]
        base = (torch.randn(base_shape, generator=torch.Generator().manual_seed(seed)) * 5).to(dtype)
        index = tuple(
            slice(start, start + size * step, step) for start, size, step in zip(starts, shape, steps)
        )
        tensor = base[index]
        if ndim >= 2 and draw(st.booleans()):
            first, second = draw(st.permutations(range(ndim)))[:2]
            tensor = tensor.transpose(first, second).contiguous().transpose(first, second)
        return tensor

    src_dtype, dst_dtype = draw(st.sampled_from(FLOAT_DTYPES)), draw(st.sampled_from(FLOAT_DTYPES))
    src = view(src_dtype, draw(st.integers(0, 1000)))
    dst = torch.zeros_like(view(dst_dtype, 0))
    dst = dst if draw(st.booleans()) else view(dst_dtype, 1)
    return src, dst
