"""The modelled hybridflow transition (the step simulator's reshard) counts every expert byte:
the EP all-gather as a ring and, at an expert TP size apart from t, the parts sent point to point."""

from dataclasses import replace

import pytest

from rl3d.costs.cluster import Cluster
from rl3d.costs.mechanisms import MECHANISMS, mechanism_cost
from rl3d.hybrid_engine.params import SegmentTable
from rl3d.hybrid_engine.plan import PlanContext, plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

# Qwen3-30B-A3B's widths and 128 experts on 4 layers: the same per-layer traffic, planned fast
QWEN = replace(get_model_spec("qwen3-30b-a3b"), num_layers=4)


def _cost(train: ParallelLayout, t_g: int, cluster: Cluster) -> tuple[dict, int]:
    plan = plan_transition(QWEN, train, t_g, strategies=("hybridflow",))
    ctx = PlanContext(QWEN, plan.gen, plan.dtype_bytes, plan.params, SegmentTable(plan.params, train.t))
    return mechanism_cost(MECHANISMS["hybridflow"](ctx, plan, cluster), cluster), plan.strategies[
        "hybridflow"
    ].comm_bytes_max


def test_expert_parts_inside_a_node_cost_their_nvlink_time():
    cluster = Cluster()
    cost, recv = _cost(ParallelLayout(1, 4, 8, ep=8, etp=1), 4, cluster)
    # no collective: the dense weights stay (t_g = t), the experts' parts move point to point
    assert set(cost["terms"]) == {"point_to_point_0"}
    assert cost["bytes_max"] == recv > 0
    latency = cluster.nccl.ring_seconds(2, 1)
    assert cost["seconds"] == pytest.approx(recv / (cluster.nvlink_gbps * 1e9) + latency, rel=1e-9)
    assert cost["calls"] == 1


def test_expert_parts_across_nodes_cost_the_node_link():
    # 4 GPUs per node: a node's link carries 4 ranks x 4 of their 7 senders' equal shares
    cluster = Cluster(gpus_per_node=4)
    cost, recv = _cost(ParallelLayout(1, 4, 8, ep=8, etp=1), 4, cluster)
    latency = cluster.nccl.ring_seconds(2, 2)
    assert cost["seconds"] == pytest.approx(16 / 7 * recv / (cluster.node_gbps * 1e9) + latency, rel=1e-9)


def test_ep_all_gather_is_its_own_ring_phase():
    cluster = Cluster()
    cost, recv = _cost(ParallelLayout(1, 4, 8, ep=8), 4, cluster)
    assert set(cost["terms"]) == {"micro_dp_all_gather"}  # the expert all-gather, the only one
    # each EP ring enters every one of the 4 nodes once; the 4 rings at once
    latency = cost["calls"] * cluster.nccl.ring_seconds(8, 4)
    assert cost["seconds"] == pytest.approx(4 * recv / (cluster.node_gbps * 1e9) + latency, rel=1e-9)
