"""The memory plan with expert TP apart from TP: a rank holds E/ep experts per layer, each split
over etp (not tp) ranks, in an expert buffer data-parallel over t d / (ep etp) ranks."""

from pathlib import Path

from rl3d.models.spec import get_model_spec
from rl3d.planning.memory_train import layout_static_bytes, stage_numels

ROOT = Path(__file__).resolve().parents[3]
SPEC = get_model_spec("qwen3-30b-a3b")  # 48 layers, 128 experts of width 768, hidden 2048
WHERE = {"tp": 4, "pp": 1, "pp_rank": 0, "ep": 8}


def test_experts_split_by_etp_dense_by_tp():
    one_expert = 3 * 2048 * 768  # fc1 [2 fe, h] + fc2 [h, fe]
    experts_etp1 = stage_numels(SPEC, "actor", **WHERE, experts=True, etp=1)
    experts_etp4 = stage_numels(SPEC, "actor", **WHERE, experts=True)
    assert sum(experts_etp1) == 48 * 128 // 8 * one_expert  # 16 whole experts a layer
    assert sum(experts_etp4) * 4 == sum(experts_etp1)  # the default: split over tp = 4
    dense = stage_numels(SPEC, "actor", **WHERE, experts=False)
    assert stage_numels(SPEC, "actor", **WHERE, experts=False, etp=1) == dense


def test_expert_states_shard_over_the_expert_data_parallel_ranks():
    common = {"dtype_bytes": 2, "trainable": True, **WHERE, "dp": 8}
    plain = {
        k: layout_static_bytes(SPEC, "actor", **common, distributed_optimizer=False, etp=e)
        for k, e in (("tp", None), ("one", 1))
    }
    expert_bytes = 48 * 16 * 3 * 2048 * 768 * 2  # a rank's experts, bf16, whole
    assert plain["one"].params - plain["tp"].params == expert_bytes * 3 // 4
    # the distributed optimizer: 4x the expert weights over 4x the expert-DP ranks (1 -> 4)
    dist = {
        k: layout_static_bytes(SPEC, "actor", **common, distributed_optimizer=True, etp=e)
        for k, e in (("tp", None), ("one", 1))
    }
    ratio = dist["one"].optimizer / dist["tp"].optimizer
    assert 0.99 < ratio < 1.01, ratio
