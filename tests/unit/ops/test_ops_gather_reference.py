"""The torch reference of gather_to_layout against generation shards cut from the full tensor."""

import pytest
import torch
from ops_cases import Case, expected_hf_qkv, full_tensor

from rl3d.ops import GatheredShards, ParamLayout, ShardKind, gather_to_layout, output_shape

TP_PAIRS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2)]
KINDS = [
    ParamLayout(kind=ShardKind.COLUMN),
    ParamLayout(kind=ShardKind.ROW),
    ParamLayout(kind=ShardKind.REPLICATED),
    ParamLayout(kind=ShardKind.SWIGLU_FC1),
    ParamLayout(kind=ShardKind.VOCAB, vocab_size=1000),
    ParamLayout(kind=ShardKind.QKV, num_heads=32, num_query_groups=8),
    ParamLayout(kind=ShardKind.QKV, num_heads=8, num_query_groups=8),
]


@pytest.mark.parametrize("layout", KINDS, ids=lambda layout: f"{layout.kind.value}")
@pytest.mark.parametrize("train_tp,gen_tp", TP_PAIRS)
@pytest.mark.parametrize("target", ["megatron", "hf"])
def test_reference_equals_the_generation_shard_of_the_full_tensor(layout, train_tp, gen_tp, target):
    rows_unit = 4 if layout.kind is ShardKind.QKV else 16
    full = full_tensor(layout, rows_unit=rows_unit, cols=6, train_tp=train_tp, dtype=torch.float32)
    for gen_rank in range(gen_tp):
        case = Case(layout, full, train_tp, gen_tp, gen_rank, target)
        result = gather_to_layout(
            case.shards(), layout, train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target,
            backend="torch",
        )  # fmt: skip
        fused = torch.cat(result, dim=0) if target == "hf" else result
        assert torch.equal(fused, case.expected())


def test_hf_qkv_pieces_are_views_of_one_fused_buffer():
    layout = ParamLayout(kind=ShardKind.QKV, num_heads=8, num_query_groups=2)
    full = full_tensor(layout, rows_unit=4, cols=5, train_tp=2, dtype=torch.float32)
    case = Case(layout, full, 2, 1, 0, "hf")
    q, k, v = gather_to_layout(case.shards(), layout, train_tp=2, gen_tp=1, gen_rank=0, target="hf")
    expected_q, expected_k, expected_v = expected_hf_qkv(full, layout, 1, 0)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()


@pytest.mark.parametrize("train_tp,gen_tp", [(1, 4), (1, 8), (2, 8), (2, 16), (1, 2), (2, 4)])
def test_kv_heads_are_replicated_when_gen_tp_exceeds_them(train_tp, gen_tp):
    layout = ParamLayout(kind=ShardKind.QKV, num_heads=16, num_query_groups=4)
    full = full_tensor(layout, rows_unit=2, cols=3, train_tp=train_tp, dtype=torch.float32)
    for gen_rank in range(gen_tp):
        case = Case(layout, full, train_tp, gen_tp, gen_rank, "hf")
        q, k, v = gather_to_layout(
            case.shards(), layout, train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target="hf",
            backend="torch",
        )  # fmt: skip
        expected_q, expected_k, expected_v = expected_hf_qkv(full, layout, gen_tp, gen_rank)
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_vocab_padding_is_removed_only_from_the_last_shards():
    layout = ParamLayout(kind=ShardKind.VOCAB, vocab_size=300)
    full = full_tensor(layout, rows_unit=64, cols=2, train_tp=4, dtype=torch.float32)  # padded to 512
    kept = [output_shape(layout, (128, 2), 1, 4, 4, rank, "hf")[0] for rank in range(4)]
    assert kept == [128, 128, 44, 0]
    (whole,) = gather_to_layout(
        Case(layout, full, 4, 1, 0, "hf").shards(), layout, train_tp=4, gen_tp=1, gen_rank=0, target="hf"
    )
    assert torch.equal(whole, full[:300])


def test_gathered_buffer_window_equals_the_shard_list():
    layout = ParamLayout(kind=ShardKind.SWIGLU_FC1)
    full = full_tensor(layout, rows_unit=8, cols=4, train_tp=4, dtype=torch.float32)
    case = Case(layout, full, 4, 1, 0, "megatron")
    window = case.gathered(gap=5, offset=3)
    assert all(torch.equal(a, b) for a, b in zip(window.shards(), case.shards()))
    result = gather_to_layout(window, layout, train_tp=4, gen_tp=1, gen_rank=0, backend="torch")
    assert torch.equal(result, full)


def test_out_may_be_a_strided_view_of_another_dtype():
    layout = ParamLayout(kind=ShardKind.COLUMN)
    full = full_tensor(layout, rows_unit=4, cols=6, train_tp=2, dtype=torch.float32)
    engine_param = torch.zeros(8, 10, dtype=torch.bfloat16)
    gather_to_layout(
        Case(layout, full, 2, 1, 0, "megatron").shards(), layout, train_tp=2, gen_tp=1, gen_rank=0,
        out=engine_param[:, 2:8], backend="torch",
    )  # fmt: skip
    assert torch.equal(engine_param[:, 2:8], full.to(torch.bfloat16))
    assert not engine_param[:, :2].any() and not engine_param[:, 8:].any()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(train_tp=8, gen_tp=2, gen_rank=0, target="megatron"), "expected r"),
        (dict(train_tp=4, gen_tp=3, gen_rank=0, target="megatron"), "does not divide"),
        (dict(train_tp=2, gen_tp=1, gen_rank=1, target="megatron"), "outside"),
        (dict(train_tp=2, gen_tp=1, gen_rank=0, target="vllm"), "target"),
        (dict(train_tp=1, gen_tp=2, gen_rank=0, target="megatron"), "only supported for QKV"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    shards = [torch.zeros(4, 3), torch.zeros(4, 3)]
    with pytest.raises(ValueError, match=message):
        gather_to_layout(shards, ParamLayout(kind=ShardKind.COLUMN), **kwargs)


@pytest.mark.parametrize(
    "layout,shard,message",
    [
        (ParamLayout(kind=ShardKind.ROW), torch.zeros(6), "needs 2 dims"),
        (ParamLayout(kind=ShardKind.SWIGLU_FC1), torch.zeros(5, 2), "even row count"),
        (ParamLayout(kind=ShardKind.QKV, num_heads=4, num_query_groups=2), torch.zeros(10, 2), "QKV shard"),
    ],
)
def test_malformed_shards_are_named(layout, shard, message):
    with pytest.raises(ValueError, match=message):
        gather_to_layout([shard], layout, train_tp=1, gen_tp=1, gen_rank=0)


def test_gathered_window_must_fit_its_buffer():
    with pytest.raises(ValueError, match="exceeds the buffer"):
        GatheredShards(torch.zeros(10), (2, 3), 2)
