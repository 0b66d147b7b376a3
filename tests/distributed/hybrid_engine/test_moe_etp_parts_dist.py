"""Experts trained at an expert TP size apart from TP, generated at t_g > 1, on gloo: the
executor cuts each expert into lcm(etp, t_g) parts, moves the ones a rank lacks point to point
and assembles its t_g shard. Each generation weight equals the full model's slice bit for bit
(also by `verify`'s independent path), and the bytes each rank counts from each sender equal the
plan's. Megatron is not needed: the training shards are cut from a seeded full model the way
megatron's expert grid holds them (dense weights by TP rank, experts by EP and expert TP rank).
Overlapped with an optimizer step (`on_bucket`), every training tensor is updated once, before
its parts are cut and sent.
"""

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.weights import full_model
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed


def model():
    """tiny-qwen2-moe (8 experts and a shared one) with 4 KV heads, so that TP 4 splits them."""
    return replace(get_model_spec("tiny-qwen2-moe"), num_query_groups=4)


def worker(rank, world, layout, ep, etp, t_g):
    spec = model()
    train = ParallelLayout(*layout, ep=ep, etp=etp)
    gen = GenerationLayout.from_training(train, t_g, 1)
    groups = build_hybrid_groups(gen, timeout_s=60)
    plan = plan_transition(spec, train, t_g, dtype="float32", strategies=("hybridflow",))
    ctx = plan._ctx
    full = full_model(ctx.params, seed=5, dtype=torch.float32)
    shards = {}
    for i in ctx.train_params(rank):
        p = ctx.params[i]
        shards[p.name] = shard_for_tp(full[p.name], p.kind, *reversed(ctx.split_of(i, rank))).clone()
    engine = Resharder(spec, groups, dtype=torch.float32, verify=True, params=ctx.params, bucket_mb=0.01)
    weights = engine.to_generation(shards)
    mismatched = []
    for name in weights.names():
        p = weights.params[name]
        expected = shard_for_tp(full[name], p.kind, t_g, weights.gen_tp_rank)
        # the fused kernel path too for the experts (a dense QKV at TP 4 > 2 KV heads is the
        # reference's alone)
        paths = (weights.reference_materialize,) + (
            (weights.materialize,) if ".local_experts." in name else ()
        )
        for got in (path(name) for path in paths):
            if got.shape != expected.shape or not torch.equal(got, expected):
                mismatched.append(name)
    experts = {n for n in weights.names() if ".local_experts." in n}
    stats = engine.last_stats
    updated = []

    def on_bucket(bucket):  # an in-place elementwise step, so a shard's update is the full one's
        names = [q.name for q in bucket] if bucket is not None else [n for n in shards if n not in updated]
        for name in names:
            shards[name].mul_(0.5).add_(1.0)
            updated.append(name)

    weights = engine.to_generation(shards, on_bucket=on_bucket)
    for name in weights.names():
        expected = shard_for_tp(full[name] * 0.5 + 1.0, weights.params[name].kind, t_g, weights.gen_tp_rank)
        if not torch.equal(weights.reference_materialize(name), expected):
            mismatched.append(f"overlapped {name}")
    return {
        "updated_once": sorted(updated) == sorted(shards),
        "mismatched": mismatched,
        "experts": len(experts),
        "recv_from": stats.recv_from,
        "send": stats.send_bytes,
        "verified": stats.verified,
    }


@pytest.mark.parametrize(
    ("layout", "ep", "etp", "t_g"),
    [
        ((1, 4, 1), 2, 1, 2),  # a generation shard is half an expert: dense by micro-DP all-gather
        ((1, 4, 1), 2, 1, 4),  # a quarter, dense in place
        ((1, 4, 1), 2, 2, 4),  # half an etp shard
        ((1, 4, 1), 2, 2, 2),  # one etp shard, from another rank than the TP half's
    ],
    ids=lambda v: str(v),
)
def test_expert_parts_reshard_bit_for_bit_counted_as_planned(layout, ep, etp, t_g):
    train = ParallelLayout(*layout, ep=ep, etp=etp)
    results = run_distributed(worker, train.world_size, layout, ep, etp, t_g, timeout_s=300)
    plan = plan_transition(model(), train, t_g, dtype="float32", strategies=("hybridflow",))
    counted = defaultdict(int)
    for dst, r in enumerate(results):
        assert r["mismatched"] == [] and r["verified"] and r["updated_once"], (dst, r["mismatched"])
        assert r["experts"] == 2 * 8 * 2, dst  # fc1 and fc2 of all 8 experts of both layers
        assert r["send"] == plan.strategies["hybridflow"].ranks[dst].send_bytes, dst
        for src, nbytes in r["recv_from"].items():
            counted[(src, dst)] += nbytes
    assert dict(counted) == plan.pair_bytes("hybridflow")
    assert any(x.unit == "slice" for x in plan.strategies["hybridflow"].phases[0])
