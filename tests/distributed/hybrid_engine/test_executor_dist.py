"""The 3D-HybridEngine executor on real gloo process groups.

Every rank builds the same random full model, takes its Megatron training shard, and runs the
transition. Checks, per strategy and layout:
- every generation shard equals the same slice of the full model, bit for bit (plain, QKV with
  GQA, SwiGLU fc1, vocab-parallel with padding, replicated norms; fp32 and bf16);
- the bytes each rank counted equal the planner's bytes for that rank, exactly;
- hybridflow's generation weights occupy exactly the planner's M/(t_g p_g), and the rank's own
  training tensors ARE the pieces of its generation shard (same storage: no redundant copy);
  the storage it allocates is exactly the bytes it received, none in an identity transition.
"""

import pytest
import torch

import rl3d.bench  # noqa: F401  registers the baselines compared here
from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.params import model_params, stages_of
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.weights import full_model, training_shards, zero_shards
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.testing.spawn import run_distributed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transition_worker(rank, world, model, layout, t_g, p_g, strategies, dtypes, rollout_ranks):
    spec = get_model_spec(model)
    train = ParallelLayout(*layout)
    gen = GenerationLayout.from_training(train, t_g, p_g)
    groups = build_hybrid_groups(gen, timeout_s=60, rollout_ranks=rollout_ranks)
    params = model_params(spec, train_tp=train.t)
    n = train.world_size
    results = {
        "groups": {
            name: list(getattr(groups, name).ranks)
            for name in ("micro_dp", "gen_tp", "gen_pp", "gen_dp")
            if getattr(groups, name) is not None  # openrlhf's rollout ranks are in none
        }
    }
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        full = full_model(params, seed=7, dtype=dtype)
        if rank < n:
            c = train.coords(rank)
            shards = training_shards(
                full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
            )
        else:
            shards = {}
        for strategy in strategies:
            zero = (
                zero_shards(full, [p for p in params if stages_of(p, spec.num_layers, 1)], rank=rank, world=n)
                if (strategy == "ds_chat")
                else None
            )
            engine = Resharder(spec, groups, strategy=strategy, bucket_mb=0.01, verify=True, dtype=dtype)
            weights = engine.to_generation(shards, zero_shards=zero)
            stats = engine.last_stats
            mismatches, reused, names = [], None, []
            if weights is not None:
                names = weights.names()
                for name in names:
                    p = weights.params[name]
                    expected = shard_for_tp(full[name], p.kind, gen.t_g, weights.gen_tp_rank)
                    got = weights.materialize(name)
                    if got.shape != expected.shape or not torch.equal(got, expected):
                        mismatches.append(name)
                if strategy == "hybridflow":
                    own_ptrs = {t.untyped_storage().data_ptr() for t in shards.values()}
                    piece_ptrs = {t.untyped_storage().data_ptr() for t in weights.tensors()}
                    # every own shard the generation layout needs is used in place
                    needed_own = [k for k in shards if k in weights.pieces]
                    reused = all(shards[k].untyped_storage().data_ptr() in piece_ptrs for k in needed_own)
                    reused = reused and len(own_ptrs & piece_ptrs) == len(needed_own)
            results[(dtype_name, strategy)] = {
                "recv": stats.recv_bytes,
                "send": stats.send_bytes,
                "peak": stats.peak_param_bytes,
                "alloc": stats.alloc_bytes,
                "calls": stats.calls,
                "verified": stats.verified,
                "mismatches": mismatches,
                "reused": reused,
                "num_names": len(names),
            }
    return results


def check_against_plan(results, model, layout, t_g, p_g, strategies, dtypes):
    spec = get_model_spec(model)
    gen = GenerationLayout.from_training(ParallelLayout(*layout), t_g, p_g)
    expected = {
        "micro_dp": gen.micro_dp_groups(),
        "gen_tp": gen.gen_tp_groups(),
        "gen_pp": gen.gen_pp_groups(),
        "gen_dp": gen.gen_dp_groups(),
    }
    for rank, per_rank in enumerate(results[: gen.world_size]):
        for name, ranks in per_rank["groups"].items():
            assert rank in ranks and ranks in expected[name], (rank, name, ranks)
    for dtype_name in dtypes:
        plan = plan_transition(
            spec, ParallelLayout(*layout), t_g, p_g, dtype=dtype_name, strategies=strategies
        )
        for strategy in strategies:
            planned = {r.rank: r for r in plan.strategies[strategy].ranks}
            for rank, per_rank in enumerate(results):
                got = per_rank[(dtype_name, strategy)]
                where = f"{strategy} {dtype_name} rank {rank}"
                assert got["mismatches"] == [], where
                assert got["recv"] == planned[rank].recv_bytes, where
                assert got["send"] == planned[rank].send_bytes, where
                if strategy != "openrlhf" or rank >= ParallelLayout(*layout).world_size:
                    assert got["verified"] and got["num_names"] > 0, where
                if strategy == "hybridflow":
                    # the generation weights are exactly this rank's share M/(t_g p_g) of the model
                    assert got["peak"] == planned[rank].peak_param_bytes == plan.rank_bytes(rank)[1], where
                    assert got["reused"] is True, where
                    # what the transition allocated is exactly what it received: the peers' pieces
                    assert got["alloc"] == got["recv"], where
                    if gen.is_identity:  # nothing moves, nothing is allocated, no call is made
                        assert got["alloc"] == got["recv"] == got["calls"] == 0, where


FAST = [
    # (model, train p,t,d, t_g, p_g): the paper's example and PP folding into micro-DP
    ("tiny-llama", (1, 4, 2), 2, 1),
    ("tiny-llama", (2, 2, 2), 2, 1),
    ("tiny-llama", (1, 2, 1), 2, 1),  # identity: t_g = t
]
SLOW = [
    ("tiny-llama", (1, 2, 2), 1, 1),
    ("tiny-llama", (2, 4, 1), 2, 2),
    ("tiny-llama", (2, 4, 1), 1, 1),
    ("tiny-llama", (2, 2, 2), 2, 2),  # identity
    ("tiny-llama-odd-vocab", (1, 2, 2), 1, 1),
    ("tiny-qwen2", (2, 2, 1), 1, 1),  # tied embeddings + QKV bias
]
STRATEGIES_8 = ("hybridflow", "hybridflow_v", "ds_chat")


@pytest.mark.distributed
@pytest.mark.parametrize("model, layout, t_g, p_g", FAST, ids=lambda v: str(v))
def test_transition_matches_plan(model, layout, t_g, p_g):
    world = layout[0] * layout[1] * layout[2]
    dtypes = ("float32", "bfloat16")
    results = run_distributed(
        transition_worker, world, model, layout, t_g, p_g, STRATEGIES_8, dtypes, 0, timeout_s=240
    )
    check_against_plan(results, model, layout, t_g, p_g, STRATEGIES_8, dtypes)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model, layout, t_g, p_g", SLOW, ids=lambda v: str(v))
def test_transition_matches_plan_more_layouts(model, layout, t_g, p_g):
    world = layout[0] * layout[1] * layout[2]
    results = run_distributed(
        transition_worker,
        world,
        model,
        layout,
        t_g,
        p_g,
        STRATEGIES_8,
        ("float32", "bfloat16"),
        0,
        timeout_s=240,
    )
    check_against_plan(results, model, layout, t_g, p_g, STRATEGIES_8, ("float32", "bfloat16"))


@pytest.mark.distributed
def test_openrlhf_broadcast_to_separate_rollout_ranks():
    """4 trainer ranks (1-2-2) + 4 rollout ranks: rank 0 gathers and broadcasts full tensors."""
    model, layout, t_g, p_g = "tiny-llama", (1, 2, 2), 1, 1
    results = run_distributed(
        transition_worker, 8, model, layout, t_g, p_g, ("openrlhf",), ("float32",), 4, timeout_s=240
    )
    check_against_plan(results, model, layout, t_g, p_g, ("openrlhf",), ("float32",))


def release_worker(rank, world):
    from rl3d.ops.layouts import qkv_megatron_to_hf

    spec = get_model_spec("tiny-llama-odd-vocab")  # vocab 250, padded to 256 for t = 2
    train = ParallelLayout(1, 2, 1)
    groups = build_hybrid_groups(GenerationLayout.from_training(train, 1, 1), timeout_s=60)
    params = model_params(spec, train_tp=2)
    full = full_model(params, seed=3, dtype=torch.float32)
    shards = training_shards(full, params, pp_rank=0, pp=1, tp_rank=rank, tp=2, num_layers=spec.num_layers)
    before = {k: v.clone() for k, v in shards.items()}
    weights = Resharder(spec, groups, bucket_mb=0.01, dtype=torch.float32).to_generation(shards)
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    q, k, v = weights.materialize(qkv, target="hf")
    eq, ek, ev = qkv_megatron_to_hf(
        full[qkv], num_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups
    )
    (emb,) = weights.materialize("embedding.word_embeddings.weight", target="hf")
    gate, up = weights.materialize("decoder.layers.0.mlp.linear_fc1.weight", target="hf")
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    hf_ok = (
        torch.equal(q, eq)
        and torch.equal(k, ek)
        and torch.equal(v, ev)
        and torch.equal(emb, full["embedding.word_embeddings.weight"][:250])
        and torch.equal(torch.cat([gate, up]), fc1)
    )
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in weights.buffers)
    weights.release()
    devices = {b.device.type for b in weights.buffers}
    try:
        weights.materialize(qkv)
        usable_after = True
    except RuntimeError:
        usable_after = False
    unchanged = all(torch.equal(before[k], shards[k]) for k in shards)
    return {
        "hf_ok": hf_ok,
        "buffer_bytes": buffer_bytes,
        "kept": len(weights.buffers),
        "devices": devices,
        "usable_after": usable_after,
        "unchanged": unchanged,
    }


@pytest.mark.distributed
def test_hf_layout_and_release_after_rollout():
    """After rollout the buffers are freed: nothing kept, nothing usable, training weights intact."""
    results = run_distributed(release_worker, 2, timeout_s=120)
    for r in results:
        assert r["hf_ok"] and r["buffer_bytes"] > 0 and not r["usable_after"] and r["unchanged"]
        assert (r["kept"], r["devices"]) == (0, set())


@pytest.mark.slow
@pytest.mark.distributed
def test_transition_reads_cp_ranks_as_data_replicas():
    """Training at TP 2 x CP 2 (4 ranks, each holding the TP shard its coordinates in the CP
    layout name), generating at t_g 1: the transition plans and runs on the layout with CP
    counted as data replicas (1-2-2), every rank gets the whole model bit for bit and counts
    exactly the planned bytes."""
    layout = (1, 2, 1, 1, None, 2)  # p, t, d, ep, etp, cp
    strategies, dtypes = ("hybridflow",), ("float32",)
    world = ParallelLayout(*layout).world_size
    results = run_distributed(
        transition_worker, world, "tiny-llama", layout, 1, 1, strategies, dtypes, 0, timeout_s=480
    )
    check_against_plan(results, "tiny-llama", layout, 1, 1, strategies, dtypes)
