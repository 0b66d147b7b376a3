"""The measured benchmark on 4 gloo ranks with a rank -> node map that places the rollout ranks
too: openrlhf's links are counted (they were left out before) and match the plan, and every
strategy makes exactly the calls `rl3d.bench.link_model` charges for."""

import pytest

import rl3d.bench  # noqa: F401  registers the baselines
from rl3d.bench.link_model import LinkSetup, model_strategy
from rl3d.bench.measured import _training_nodes, run_measured
from rl3d.hybrid_engine.nodes import NodeMap
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

STRATEGIES = ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")
NODES = [[0, 2], [1, 3]]  # training ranks 0, 1 and rollout ranks 2, 3 spread over two nodes


@pytest.mark.distributed
def test_counted_links_and_calls_match_the_model():
    out = run_measured(
        "tiny-llama", (1, 2, 1), 1, 1, strategies=STRATEGIES, repeats=1, warmup=0, bucket_mb=0.05, nodes=NODES
    )
    nodes = NodeMap.of(NODES)
    plan = plan_transition(
        get_model_spec("tiny-llama"),
        ParallelLayout(1, 2, 1),
        1,
        1,
        dtype="float32",
        strategies=STRATEGIES,
        nodes=_training_nodes(nodes, 2),
    )
    for name, s in out["strategies"].items():
        model = model_strategy(plan, name, LinkSetup(nodes, 1.0), bucket_mb=0.05)
        assert s["links_match"] is True, name
        assert s["links"]["inter_out"] == model["planned_links"]["inter_out"], name
        assert s["calls_max"] == model["calls_max"], name
    assert out["strategies"]["openrlhf"]["links"]["inter_out"]["0"] > 0  # the broadcast to rank 3
