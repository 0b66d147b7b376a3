"""The cost models by hand: NCCL's per-call ring latency, one phase's link bytes and time, the
executor's bucket count, and the optimizer step through HBM."""

import pytest

from rl3d.costs.cluster import Cluster
from rl3d.costs.mechanisms import Phase, bucket_rounds, phase_cost
from rl3d.costs.nccl import NCCL_2_18
from rl3d.costs.optimizer import ADAM_BYTES_PER_PARAM, adam_seconds


def test_nccl_ring_latency_from_tuning_tables():
    assert NCCL_2_18.ring_seconds(8, 1) == pytest.approx((8.4 + 7 * 3.4) * 1e-6)
    # 128 ranks on 16 nodes: 112 intra-node steps at the 6 us network floor, 15 at 14 us
    assert NCCL_2_18.ring_seconds(128, 16) == pytest.approx((8.4 + 112 * 6 + 15 * 14) * 1e-6)
    assert 0.85e-3 < NCCL_2_18.ring_seconds(128, 16) < 0.95e-3
    assert 0.40e-3 < NCCL_2_18.ring_seconds(64, 8) < 0.46e-3
    assert NCCL_2_18.ring_seconds(1, 1) == 0.0


def test_phase_cost_by_hand():
    cluster = Cluster()
    # 8 two-member rings, each with one GPU on node 0 and one on node 1: each node link carries 8 GB in
    groups = [[i, 8 + i] for i in range(8)]
    phase = Phase("x", "ring", groups, {r: 10**9 for g in groups for r in g}, calls=3)
    cost = phase_cost(phase, cluster)
    assert cost["node_in"] == {0: 8 * 10**9, 1: 8 * 10**9}
    lat = 3 * NCCL_2_18.ring_seconds(2, 2)
    assert cost["seconds"] == pytest.approx(8e9 / 25e9 + lat)
    # a broadcast chain rooted at 9 (node 1): 9 -> 10 -> 1 -> 2, the message enters node 0 once
    chain = Phase("b", "chain", [[9, 1, 2, 10]], {1: 10**9, 2: 10**9, 10: 10**9})
    assert phase_cost(chain, cluster)["node_in"] == {0: 10**9}
    assert (
        bucket_rounds([5, 5, 5], 10) == 2 and bucket_rounds([20, 1], 10) == 2 and bucket_rounds([], 10) == 0
    )


def test_adam_moves_30_bytes_per_parameter_through_hbm():
    assert ADAM_BYTES_PER_PARAM == 30
    assert adam_seconds(2e9, 2000.0) == pytest.approx(2e9 * 30 / 2e12)
