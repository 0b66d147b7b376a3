"""rl3d.bench.link_model: the executor's calls and gloo's wire bytes on any rank -> node map
(rollout ranks included), checked against bytes computed by hand for tiny-llama.

tiny-llama (fp32): sharded tensors 124928 elements (embedding and output 256x64, per layer qkv
128x64, proj 64x64, fc1 352x64, fc2 64x176), five norms of 64; 125248 elements in all, so the
whole model M = 500992 B and one TP=2 shard of the sharded tensors S = 249856 B."""

import pytest

import rl3d.bench  # noqa: F401  registers the baselines
from rl3d.bench.link_model import LinkSetup, executor_calls, model_strategy, ring, tree
from rl3d.hybrid_engine.nodes import NodeMap
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

M, S = 125248 * 4, 62464 * 4
ALL = ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")


def plan(t=2, d=1):
    layout = ParallelLayout(1, t, d)
    return plan_transition(get_model_spec("tiny-llama"), layout, 1, 1, dtype="float32", strategies=ALL)


def model(p, strategy, nodes, gbit=0.1, alpha_s=0.0):
    return model_strategy(p, strategy, LinkSetup(NodeMap.of(nodes), gbit, alpha_s=alpha_s), bucket_mb=64.0)


def test_gloo_binomial_tree_and_ring():
    # gloo/broadcast.cc: virtual rank v < 2^i sends to v + 2^i in round i; the root is virtual rank 0
    assert tree([0, 2, 3], 0, 10).rounds == ({(0, 2): 10}, {(0, 3): 10})
    assert tree([0, 1, 2, 3], 1, 10).rounds == ({(1, 2): 10}, {(1, 3): 10, (2, 0): 10})
    call = ring([3, 1, 0, 2], dict.fromkeys(range(4), 5))  # group-rank order: sorted
    assert call.rounds == ({(0, 1): 15, (1, 2): 15, (2, 3): 15, (3, 0): 15},) and call.steps == 3


def test_one_rank_per_node_hand_computed():
    p = plan()
    hf = model(p, "hybridflow", [[0], [1]], alpha_s=1e-3)
    assert hf["wire_sent"] == {"0": S, "1": S} == hf["planned_links"]["inter_out"]
    assert hf["calls_max"] == 1  # one bucket, equal sizes: one ring all-gather
    assert hf["seconds"] == pytest.approx(S * 8 / 0.1e9 + 1e-3)
    ds = model(p, "ds_chat", [[0], [1]])
    assert ds["wire_sent"] == {"0": M // 2, "1": M // 2}  # ZeRO-3 chunks of every tensor, norms too
    assert ds["calls_max"] == 15  # one all-gather per tensor


def test_openrlhf_rollout_ranks_on_the_map():
    p = plan()  # world 4: training ranks 0, 1; rollout ranks 2, 3
    spread = model(p, "openrlhf", [[0, 2], [1, 3]])
    # rank 1 sends its shards to rank 0 (10 sharded tensors), then rank 0 broadcasts M to 2 (its
    # node) and 3 (across): one copy of the model leaves node 0
    assert spread["wire_sent"] == {"0": M, "1": S}
    assert spread["planned_links"]["inter_out"] == {"0": M, "1": S}
    assert spread["calls_max"] == 11
    local = 20e9 / 8
    # the gather crosses the link (1 -> 0), the tree's first round stays in node 0 (0 -> 2)
    assert spread["seconds"] == pytest.approx(S * 8 / 0.1e9 + M / local + M * 8 / 0.1e9)
    apart = model(p, "openrlhf", [[0, 1], [2, 3]])  # the rollout ranks on their own node
    assert apart["wire_sent"] == {"0": 2 * M, "1": 0}  # gloo's tree: the root sends each a copy
    assert apart["seconds"] == pytest.approx(S / local + 2 * M * 8 / 0.1e9)
    with pytest.raises(ValueError, match=r"ranks \[3\] of openrlhf"):
        model(p, "openrlhf", [[0, 2], [1]])


def test_ring_wire_differs_from_logical_bytes():
    p = plan(t=2, d=2)  # ds_chat over 4 ranks, 2 per node: chunk C = M / 4 per rank
    ds = model(p, "ds_chat", [[0, 1], [2, 3]])
    assert ds["planned_links"]["inter_out"]["0"] == 4 * M // 4  # ranks 0, 1 each send C to 2 and 3
    assert ds["wire_sent"] == {"0": 3 * M // 4, "1": 3 * M // 4}  # the ring's hop 1 -> 2 carries 3 C


def test_calls_follow_the_executor_buckets():
    p = plan()
    sizes = [len(executor_calls(p, "hybridflow", bucket_mb=mb)) for mb in (64.0, 0.1)]
    assert sizes[0] == 1 and sizes[1] > 1


def test_tbf_bucket_sends_its_burst_at_once():
    p = plan()
    burst = 64 * 1024
    setup = LinkSetup(NodeMap.of([[0], [1]]), 0.1, alpha_s=1e-3, burst_bytes=burst)
    hf = model_strategy(p, "hybridflow", setup, bucket_mb=64.0)
    assert hf["seconds"] == pytest.approx(1e-3 + (S - burst) * 8 / 0.1e9)  # a full bucket first
    # ds_chat's 15 small all-gathers: the bucket refills during each call's latency, so the
    # latency hides under the transfer instead of adding to it
    nominal = model(p, "ds_chat", [[0], [1]], alpha_s=1e-3)
    banked = model_strategy(p, "ds_chat", setup, bucket_mb=64.0)
    assert banked["seconds"] < nominal["seconds"] - 15 * 1e-3 * 0.5
