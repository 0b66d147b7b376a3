"""The transition overlapped with the optimizer step (`to_generation(on_bucket=...)`) on gloo.

The hook is called bucket by bucket, in order, with this rank's pieces of each bucket before
they move, then once with None; the weights and the counted bytes are exactly those of the
plain call; a strategy without bucketed all-gathers refuses the hook.
"""

import pytest
import torch

import rl3d.bench  # noqa: F401  registers the baselines
from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import full_model, training_shards
from rl3d.models.spec import get_model_spec
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.testing.spawn import run_distributed


def overlap_worker(rank, world, layout, t_g):
    spec = get_model_spec("tiny-llama")
    train = ParallelLayout(*layout)
    groups = build_hybrid_groups(GenerationLayout.from_training(train, t_g, 1), timeout_s=60)
    params = model_params(spec, train_tp=train.t)
    full = full_model(params, seed=5, dtype=torch.float32)
    c = train.coords(rank)
    shards = training_shards(
        full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
    )
    engine = Resharder(spec, groups, strategy="hybridflow", bucket_mb=0.005, dtype=torch.float32)
    plain = engine.to_generation(shards)
    plain_stats = engine.last_stats
    expected = {n: plain.materialize(n).clone() for n in plain.names()}
    calls = []
    overlapped = engine.to_generation(
        shards, on_bucket=lambda ps: calls.append(None if ps is None else [p.name for p in ps])
    )
    same = all(torch.equal(overlapped.materialize(n), expected[n]) for n in expected)
    refused = None
    try:
        Resharder(spec, groups, strategy="ds_chat").to_generation(shards, on_bucket=lambda ps: None)
    except ValueError as err:
        refused = str(err)
    moved = [
        name
        for c in engine.plan.collectives
        if c.group_of(rank)
        for i in c.group_of(rank)[1][rank]
        for name in [params[i].name]
    ]
    return {
        "same": same and sorted(expected) == sorted(overlapped.names()),
        "bytes": (plain_stats.recv_bytes, engine.last_stats.recv_bytes),
        "calls": calls,
        "moved": moved,
        "refused": refused,
    }


@pytest.mark.distributed
def test_overlapped_transition_equals_plain():
    results = run_distributed(overlap_worker, 4, (2, 2, 1), 1, timeout_s=180)
    for rank, got in enumerate(results):
        assert got["same"], rank
        assert got["bytes"][0] == got["bytes"][1] > 0, rank
        buckets = [c for c in got["calls"] if c is not None]
        assert len(buckets) > 1 and None in got["calls"], rank
        # every piece this rank sends is updated first, once, in the order it is packed
        assert [n for b in buckets for n in b] == got["moved"], rank
        assert "cannot overlap" in got["refused"], rank
