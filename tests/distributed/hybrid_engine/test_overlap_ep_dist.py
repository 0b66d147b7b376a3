"""The transition overlapped with the optimizer step at expert parallelism 2 on gloo.

At ep > 1 HybridFlow runs two all-gathers: the dense weights over each micro-DP group, then the
experts over the EP group's micro-DP groups joined. The hook must update each piece once,
before it is packed, and hear None once, after the last bucket has started. The test's hook
updates the training tensors in place (a deterministic step standing in for the optimizer's):
the generation weights must equal the updated full model's generation shard bit for bit (a
piece packed before its update, or updated twice, would differ), and the bytes counted equal
the plan's.
"""

import pytest
import torch

from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import full_model, training_shards
from rl3d.models.params import expert_owner
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed


def _step(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The update the hook applies, element by element (so a shard's update is the full
    tensor's, sharded), different per parameter and not idempotent."""
    return tensor * 0.5 + (1 + sum(map(ord, name)) % 97) / 97


def worker(rank, world, layout, t_g):
    spec = get_model_spec("tiny-qwen3-moe")
    train = ParallelLayout(*layout[:3], ep=layout[3])
    gen = GenerationLayout.from_training(train, t_g, 1)
    groups = build_hybrid_groups(gen, timeout_s=60)
    params = model_params(spec, train_tp=train.t)
    full = full_model(params, seed=5, dtype=torch.float32)
    c = train.coords(rank)
    shards = training_shards(
        full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
    )
    experts = {p.name: p.expert for p in params if p.expert is not None}
    # this rank trains only its EP rank's experts
    shards = {
        n: t
        for n, t in shards.items()
        if n not in experts or expert_owner(spec, experts[n], train.ep)[0] == c.ep
    }
    engine = Resharder(spec, groups, strategy="hybridflow", bucket_mb=0.005, dtype=torch.float32)
    updated, calls = [], []

    def on_bucket(bucket):
        calls.append(None if bucket is None else len(bucket))
        names = [p.name for p in bucket] if bucket is not None else [n for n in shards if n not in updated]
        for name in names:
            if name in shards:
                shards[name].copy_(_step(name, shards[name]))
                updated.append(name)

    weights = engine.to_generation(shards, on_bucket=on_bucket)
    stats, planned = engine.last_stats, engine.plan.ranks[rank]
    by_name = {p.name: p for p in params}
    tp_g = gen.coords(rank).tp_g
    mismatched = [
        name
        for name in weights.names()
        if not torch.equal(
            weights.reference_materialize(name),
            shard_for_tp(_step(name, full[name]), by_name[name].kind, t_g, tp_g),
        )
    ]
    return {
        "mismatched": mismatched,
        "checked": len(weights.names()),
        "gen_experts": len({experts[n] for n in weights.names() if n in experts}),
        "twice": len(updated) - len(set(updated)),
        "missed": sorted(set(shards) - set(updated)),
        "calls": calls,
        "recv": (stats.recv_bytes, planned.recv_bytes),
        "send": (stats.send_bytes, planned.send_bytes),
        "collectives": len(engine.plan.collectives),
    }


@pytest.mark.parametrize(
    ("layout", "t_g"),  # (p, t, d, ep)
    [
        ((1, 1, 2, 2), 1),  # identity for the dense weights: the experts' all-gather alone
        ((1, 2, 2, 2), 1),  # TP folds into micro-DP: the dense all-gather, then the experts'
        ((2, 1, 2, 2), 1),  # PP folds into micro-DP: dense, experts, then the norms' all-gather
    ],
)
def test_overlapped_transition_at_ep_2_gives_the_updated_weights(layout, t_g):
    p, t, d, _ = layout
    results = run_distributed(worker, p * t * d, layout, t_g, timeout_s=240)
    for rank, got in enumerate(results):
        assert got["checked"] > 0 and got["mismatched"] == [], (rank, got["mismatched"])
        assert got["gen_experts"] == 8, rank  # every expert of the model, 4 of them received
        assert got["twice"] == 0 and got["missed"] == [], rank
        assert got["calls"].count(None) == 1 and got["calls"][-1] is None, (rank, got["calls"])
        assert len(got["calls"]) > 2, rank  # buckets, not one update
        assert got["recv"][0] == got["recv"][1] > 0, rank
        assert got["send"][0] == got["send"][1], rank
    assert results[0]["collectives"] == {(1, 1): 1, (1, 2): 2, (2, 1): 3}[(p, t)]
