"""The hierarchical gather on gloo, ranks grouped into simulated nodes.

Per layout and node grouping (contiguous, and nodes that are not runs of ranks):
- every rank's generation shard equals the full model's slice, bit for bit, for both
  `hybridflow` and `hybridflow_hier` (their weights are the same; only the routing differs);
- the bytes each rank counted from each sender equal the planner's, so the bytes counted on
  every link (inside each node, each node's network link in and out) equal the planned ones;
- the hierarchical plan carries fewer bytes over the busiest node link than plain hybridflow.
"""

from collections import defaultdict

import pytest
import torch

import rl3d.bench  # noqa: F401  registers hybridflow_hier
from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.nodes import NodeMap, link_bytes
from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.weights import full_model, training_shards
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.testing.spawn import run_distributed

STRATEGIES = ("hybridflow", "hybridflow_hier")


def hier_worker(rank, world, model, layout, t_g, nodes, dtype_name):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    spec = get_model_spec(model)
    train = ParallelLayout(*layout)
    gen = GenerationLayout.from_training(train, t_g, 1)
    groups = build_hybrid_groups(gen, timeout_s=60)
    params = model_params(spec, train_tp=train.t)
    full = full_model(params, seed=3, dtype=dtype)
    c = train.coords(rank)
    shards = training_shards(
        full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
    )
    out = {}
    for strategy in STRATEGIES:
        engine = Resharder(
            spec, groups, strategy=strategy, dtype=dtype, verify=True, nodes=NodeMap.of(nodes), bucket_mb=0.01
        )
        weights = engine.to_generation(shards)
        mismatches = []
        for name in weights.names():
            p = weights.params[name]
            expected = shard_for_tp(full[name], p.kind, gen.t_g, weights.gen_tp_rank)
            if not torch.equal(weights.materialize(name), expected):
                mismatches.append(name)
        stats = engine.last_stats
        out[strategy] = {
            "recv_from": stats.recv_from,
            "peak": stats.peak_param_bytes,
            "verified": stats.verified,
            "mismatches": mismatches,
            "names": len(weights.names()),
        }
    return out


CASES = [
    # (layout p,t,d, t_g, nodes): PP folds into micro-DP, so node-mates need the same remote stage
    ((2, 2, 1), 1, [[0, 1], [2, 3]]),
    ((2, 2, 1), 1, [[0, 3], [1, 2]]),  # nodes given by the caller, not runs of ranks
]


def _check(results, layout, t_g, nodes, dtype_name):
    node_map = NodeMap.of(nodes)
    plan = plan_transition(
        get_model_spec("tiny-llama"),
        ParallelLayout(*layout),
        t_g,
        1,
        dtype=dtype_name,
        strategies=STRATEGIES,
        nodes=node_map,
    )
    counted_links = {}
    for strategy in STRATEGIES:
        planned_pairs = plan.pair_bytes(strategy)
        counted_pairs = defaultdict(int)
        for dst, per_rank in enumerate(results):
            got = per_rank[strategy]
            assert got["mismatches"] == [] and got["verified"] and got["names"] > 0, (strategy, dst)
            assert got["peak"] == plan.strategies[strategy].ranks[dst].peak_param_bytes, (strategy, dst)
            for src, nbytes in got["recv_from"].items():
                counted_pairs[(src, dst)] += nbytes
        assert dict(counted_pairs) == planned_pairs, strategy
        counted_links[strategy] = link_bytes(dict(counted_pairs), node_map)
        assert counted_links[strategy] == plan.link_bytes(strategy, node_map), strategy
    hier, flat = counted_links["hybridflow_hier"], counted_links["hybridflow"]
    assert hier.node_bytes_max < flat.node_bytes_max
    assert hier.inter_total < flat.inter_total
    assert plan.strategies["hybridflow_hier"].links == hier.to_json()


@pytest.mark.distributed
@pytest.mark.parametrize("layout, t_g, nodes", CASES, ids=lambda v: str(v))
def test_hierarchical_gather_counts_planned_bytes_per_link(layout, t_g, nodes):
    results = run_distributed(hier_worker, 4, "tiny-llama", layout, t_g, nodes, "bfloat16", timeout_s=180)
    _check(results, layout, t_g, nodes, "bfloat16")


@pytest.mark.slow
@pytest.mark.distributed
def test_hierarchical_gather_two_nodes_of_four_with_data_parallel_replicas():
    # 2 x 4: node-mates of two DP replicas need the same stage from the other node
    layout, t_g, nodes = (2, 2, 2), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]
    results = run_distributed(hier_worker, 8, "tiny-llama", layout, t_g, nodes, "float32", timeout_s=240)
    _check(results, layout, t_g, nodes, "float32")
