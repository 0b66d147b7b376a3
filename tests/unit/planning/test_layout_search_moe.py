"""Layout search for a mixture of experts: the step simulator's footprint counts a rank's
experts as the memory plan does (E/ep of them, their optimizer state over d/ep), the search
tries expert parallelism for the actor, and it lists only candidates the recipe accepts."""

import pytest

from rl3d.config import load_config
from rl3d.config.errors import ConfigError
from rl3d.parallel import ParallelLayout
from rl3d.planning import plan_memory
from rl3d.planning.auto_layout import actor_layout_check, auto_layout, overrides_of
from rl3d.planning.devices import A100, H100, H200
from rl3d.planning.footprint import _static_bytes, generation_extra_bytes
from rl3d.planning.layout_search import PoolChoice, search_run_layouts
from rl3d.planning.recipe import run_layout_of, workload_of
from rl3d.planning.workload import PoolLayout, RunLayout

MOE = "recipes/quickstart_cpu_moe_grpo.yaml"
# a published shape on the 7B GRPO recipe's workload (bf16, packing, the distributed optimizer)
GPU = "recipes/gpu_llama2_7b_grpo.yaml"
Q30 = ["model.name=qwen3-30b-a3b", "actor.parallel.tp=1", "rollout.t_g=1"]


def _loader(recipe, base=()):
    return lambda overrides: load_config(recipe, [*base, *overrides]).config


def _footprint_against_plan(cfg):
    """(footprint, plan) per rank of the actor's pool: static bytes, generation weights added."""
    w, run_layout = workload_of(cfg), run_layout_of(cfg)
    pool = run_layout.pool_of("actor")
    plan = plan_memory(cfg)
    got, want = [], []
    for rank in plan.ranks:
        stage = pool.layout.coords(rank.rank).pp
        got.append((_static_bytes(pool, w, stage), generation_extra_bytes(w, run_layout, pool, stage)))
        train = rank.phases["train"]
        statics = sum(e.static for name, e in train.items() if name != "engine")
        want.append((statics, rank.phases["reshard"]["engine"].resharded))
    return got, want


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        (MOE, []),  # ep 2 on 2 ranks, fp32
        (MOE, ["actor.parallel.ep=1"]),
        (GPU, [*Q30, "actor.parallel.dp=8", "actor.parallel.ep=8"]),  # bf16, distributed optimizer
        (GPU, [*Q30, "actor.parallel.pp=2", "actor.parallel.dp=4", "actor.parallel.ep=2"]),
    ],
)
def test_footprint_counts_the_experts_as_the_memory_plan_does(recipe, overrides):
    cfg = load_config(recipe, [*overrides, f"launch.nproc_per_node={_world(overrides)}"]).config
    got, want = _footprint_against_plan(cfg)
    assert got == want  # byte for byte, every rank


def _world(overrides):
    par = {k.split(".")[-1]: int(v) for k, v in (o.split("=") for o in overrides if "parallel" in o)}
    return par.get("pp", 1) * par.get("tp", 1) * par.get("dp", 2)


def test_footprint_divides_the_experts_by_ep():
    base = [*Q30, "actor.parallel.dp=8", "launch.nproc_per_node=8"]
    ep1 = load_config(GPU, [*base, "actor.parallel.ep=1"]).config
    ep8 = load_config(GPU, [*base, "actor.parallel.ep=8"]).config
    w, spec = workload_of(ep1), workload_of(ep1).actor
    one, eight = (_static_bytes(run_layout_of(c).pools[0], w, 0) for c in (ep1, ep8))
    experts = spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_ffn_hidden_size
    # the actor, distributed optimizer, d 8. ep 1: every expert, bf16 params + fp32 grads (6 bytes)
    # and fp32 master + Adam (12) over 8 ranks. ep 8: 1/8 of the experts, their master + Adam
    # over d/ep = 1. The reference (KL) on the same ranks: bf16 params (2), 1/8 of them at ep 8
    assert w.roles == ("actor", "reference")
    actor = (6 + 12 / 8) - (6 + 12) / 8
    reference = 2 - 2 / 8
    assert one - eight == pytest.approx(experts * (actor + reference), rel=1e-3)


def test_every_candidate_states_its_ep_and_loads():
    cfg = load_config(MOE).config
    load = _loader(MOE)
    out = auto_layout(cfg, load, gpus=4, device=A100, top=20)
    assert out["best"] is not None and len(out["candidates"]) >= 5
    for entry in out["candidates"]:
        loaded = load(entry["overrides"])  # raises if the recipe refuses it
        assert run_layout_of(loaded).describe() == entry["layout"]
        assert any(o.startswith("actor.parallel.ep=") for o in entry["overrides"])


def test_30b_a3b_is_placed_with_expert_parallelism_the_recipe_accepts():
    base = [*Q30, "actor.parallel.dp=8", "actor.parallel.ep=8"]
    load = _loader(GPU, base)
    out = auto_layout(load([]), load, gpus=16, device=H200, top=8)
    assert out["best"] is not None and out["best"]["fits"]
    for entry in out["candidates"]:
        loaded = load(entry["overrides"])
        assert run_layout_of(loaded).describe() == entry["layout"]
    # the trainer's refusals (an actor layout) were asked during the search, not listed
    assert not [r for r in out["rejected"] if "actor.parallel" in r["error"]]
    # the chosen actor splits the experts' state (over TP, PP or EP), at tp > 1 under sequence
    # parallelism (megatron's MoE layer needs it there); expert parallelism is listed too
    chosen = run_layout_of(load(out["best"]["overrides"])).pool_of("actor")
    assert chosen.layout.t * chosen.layout.p * chosen.layout.ep > 1
    assert chosen.layout.t == 1 or chosen.sequence_parallel == ("actor",)
    assert any(" ep" in e["layout"] for e in out["candidates"])


def test_an_actor_layout_the_recipe_refuses_is_not_searched():
    base = [*Q30, "actor.parallel.dp=8", "actor.parallel.ep=8"]
    load = _loader(GPU, base)
    w = workload_of(load([]))
    ok = actor_layout_check(load, w.roles, 8, ep=True)

    def accepted(layout):  # the recipe itself, every role on the actor's ranks, the actor under SP
        alone = RunLayout(pools=(PoolLayout("actor", layout, w.roles, sequence_parallel=("actor",)),))
        try:
            load(overrides_of(alone, 8, ep=True))
        except ConfigError as err:
            return not err.key.startswith("actor.parallel")
        return True

    assert not ok(PoolChoice(ParallelLayout(1, 1, 6, ep=3)))  # 3 does not divide the 128 experts
    assert ok(PoolChoice(ParallelLayout(1, 1, 8, ep=8))) and ok(PoolChoice(ParallelLayout(2, 1, 4, ep=1)))
    tp2 = ParallelLayout(1, 2, 4, ep=4)
    assert ok(PoolChoice(tp2, sequence_parallel=True)) == accepted(tp2)  # what the trainer runs at tp > 1
    assert not ok(PoolChoice(tp2, sequence_parallel=False))  # megatron's MoE layer needs it at tp > 1
    asked = []

    def recorded(choice):
        asked.append(choice)
        return ok(choice)

    kept = search_run_layouts(w, H100, 8, actor_ok=recorded)
    assert any(c.layout.t > 1 for c in asked) and any(c.layout.ep > 1 for c in asked)
    assert all(c.sequence_parallel for c in asked if c.layout.t > 1)
    assert kept and all(ok(_choice(c.run_layout.pool_of("actor"))) for c in kept)


def _choice(pool):
    return PoolChoice(pool.layout, bool(pool.sequence_parallel), bool(pool.recompute))
