"""Layout search with sequence parallelism and activation recompute: the footprint counts
a pool's activations as the memory plan does, the search tries both where they apply, and the
candidates it lists are recipes that run them."""

from dataclasses import replace

import pytest

from rl3d.config import load_config
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.planning import plan_memory
from rl3d.planning.auto_layout import actor_layout_check, auto_layout
from rl3d.planning.devices import A100
from rl3d.planning.footprint import _activation_bytes, _static_bytes
from rl3d.planning.layout_search import PoolChoice, Search, search_run_layouts
from rl3d.planning.recipe import run_layout_of, workload_of
from rl3d.planning.simulator import pass_seconds, simulate
from rl3d.planning.workload import PoolLayout, RunLayout, Workload

MOE = "recipes/quickstart_cpu_moe_grpo.yaml"
PPO = "recipes/quickstart_cpu_ppo.yaml"
GPU_7B = "recipes/gpu_llama2_7b_ppo.yaml"
GPU_70B = "recipes/gpu_llama2_70b_ppo.yaml"
LLAMA7 = get_model_spec("llama2-7b")


def _loader(recipe):
    return lambda overrides: load_config(recipe, overrides).config


def test_footprint_counts_a_moe_at_tp2_as_the_memory_plan_does():
    # `auto` turns sequence parallelism on for a mixture of experts at tp 2; an odd prompt
    # length: both pad the sequence to a multiple of 2
    over = [
        "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2}",
        "launch.nproc_per_node=4",
        "data.max_prompt_length=15",
    ]
    cfg = load_config(MOE, over).config
    w, pool = workload_of(cfg), run_layout_of(cfg).pool_of("actor")
    assert pool.sequence_parallel == ("actor",)
    rank = plan_memory(cfg).ranks[0]
    assert _activation_bytes(pool, w) == rank.phases["train"]["actor"].activations  # byte for byte
    assert _static_bytes(pool, w, 0) + _activation_bytes(pool, w) == rank.peaks["train"]
    # counted without it, the hidden states between the blocks would be whole on each TP rank
    assert _activation_bytes(replace(pool, sequence_parallel=()), w) > _activation_bytes(pool, w)


@pytest.mark.parametrize(
    ("overrides", "split", "recompute", "described"),
    [
        ([], (), (), "[2: p1 t2 d1]"),  # dense: `auto` leaves it off
        (["critic.parallel.sequence_parallel=true"], ("critic",), (), "[2: p1 t2 d1 sp(critic)]"),
        (
            [
                "actor.parallel.sequence_parallel=true",
                "critic.parallel.sequence_parallel=true",
                "actor.recompute=full",
            ],
            ("actor", "critic"),
            ("actor",),
            "[2: p1 t2 d1 sp rc(actor)]",
        ),
    ],
)
def test_a_recipe_placement_runs_each_role_as_its_section_says(overrides, split, recompute, described):
    cfg = load_config(PPO, overrides).config  # actor, critic and reference at p1 t2 d1
    w, pool = workload_of(cfg), run_layout_of(cfg).pools[0]
    assert (pool.sequence_parallel, pool.recompute) == (split, recompute)
    assert described in run_layout_of(cfg).describe()
    rank = plan_memory(cfg).ranks[0]
    planned = max(e.activations for e in rank.phases["train"].values() if hasattr(e, "activations"))
    assert _activation_bytes(pool, w) == planned  # the larger role's, byte for byte


def test_sequence_parallelism_costs_no_time_and_recompute_one_forward():
    w = Workload(actor=LLAMA7, roles=("actor", "critic"), prompts=64, micro_batch_size=2)
    lay = ParallelLayout(1, 4, 2)
    plain = PoolLayout("actor", lay, w.roles)
    split = replace(plain, sequence_parallel=w.roles)
    a, b = (simulate(w, RunLayout(pools=(p,), t_g=4), A100) for p in (plain, split))
    assert a.stages == b.stages  # a reduce-scatter and an all-gather: the all-reduce's bytes
    assert b.memory_bytes["actor"] <= a.memory_bytes["actor"]
    # recompute: one more forward's FLOPs (no TP traffic at t 1, no fixed costs on an A100)
    flat = ParallelLayout(1, 1, 8)
    once = pass_seconds(LLAMA7, flat, A100, w, samples=64, backward=True)
    again = pass_seconds(LLAMA7, flat, A100, w, samples=64, backward=True, recompute=True)
    assert again == pytest.approx(once * 4 / 3, rel=1e-12)
    # at t 4 its forward's two all-reduces per layer come too: 6 in all, against 4
    fwd = pass_seconds(LLAMA7, lay, A100, w, samples=64, backward=False)
    assert pass_seconds(LLAMA7, lay, A100, w, samples=64, backward=True, recompute=True) == pytest.approx(
        pass_seconds(LLAMA7, lay, A100, w, samples=64, backward=True) + fwd, rel=1e-12
    )


def test_recompute_is_taken_only_where_an_option_does_not_fit_without_it():
    w = workload_of(load_config(GPU_7B).config)
    search = Search(w, A100, 8)
    structure = (("actor", "reference"), ("critic",))
    # the critic alone on 2 A100s fits only with recompute; on 4 without it
    for size, needs in ((2, True), (4, False)):
        _, fits, choice, t_g, p_g, _ = search.best_pool(structure, 1, size)
        assert fits and choice.recompute == needs
        plain = search._footprint(structure, 1, replace(choice, recompute=False), t_g, p_g)
        assert plain[3] == (not needs)  # fits without it


def test_every_listed_candidate_loads_with_its_sequence_parallelism_and_recompute():
    load = _loader(GPU_7B)
    out = auto_layout(load([]), load, gpus=8, device=A100, top=8)
    flags = set()
    for entry in out["candidates"]:
        loaded = load(entry["overrides"])  # raises if the recipe refuses it
        run_layout = run_layout_of(loaded)  # the loaded recipe's own sequence parallelism, recompute
        assert run_layout.describe() == entry["layout"]
        for pool in run_layout.pools:
            flags |= {("sp", pool.layout.t > 1)} if pool.sequence_parallel else set()
            flags |= {("rc", True)} if pool.recompute else set()
        assert any(o.startswith("actor.parallel.sequence_parallel=") for o in entry["overrides"])
        assert any(o.startswith("critic.recompute=") for o in entry["overrides"])
    assert flags == {("sp", True), ("rc", True)}  # a dense model: both tried, SP only at t > 1
    assert out["best"]["fits"]


def test_the_70b_recipes_choice_fits_per_the_memory_plan():
    load = _loader(GPU_70B)
    out = auto_layout(load([]), load, gpus=64, device=A100, top=2)
    best = out["best"]
    assert best is not None and best["fits"]
    cfg = load(best["overrides"])
    plan = plan_memory(cfg, device_bytes=A100.memory_bytes)
    assert plan.fits and plan.worst().peak_bytes == pytest.approx(best["memory_plan_peak_gb"] * 1e9)
    actor = run_layout_of(cfg).pool_of("actor")
    assert actor.layout.t > 1 and "actor" in actor.sequence_parallel
    assert best["gain_over_recipe"] > 1
    assert best["step_seconds"] == min(e["step_seconds"] for e in out["candidates"] if e["fits"])
    # the footprint the search ranks by counts training as the memory plan's train phase does
    # (a packed micro-batch's fp32 logits aside: the plan keeps them for every token)
    w, pool = workload_of(cfg), actor
    statics = max(_static_bytes(pool, w, j) for j in range(pool.layout.p))
    # (the device's own allowances aside: contexts, NCCL, fragmentation are the plan's alone)
    train = max(rank.peaks["train"] - rank.phases["train"]["device"].total for rank in plan.ranks)
    assert statics + _activation_bytes(pool, w) == pytest.approx(train, rel=1e-3)


def test_lora_is_not_searched_under_sequence_parallelism():
    recipe = "recipes/quickstart_cpu_lora_grpo.yaml"  # LoRA adapters read whole sequences
    load = _loader(recipe)
    w = workload_of(load([]))
    ok = actor_layout_check(load, w.roles, 8, ep=False)
    tp2 = ParallelLayout(1, 2, 1)
    assert ok(PoolChoice(tp2)) and not ok(PoolChoice(tp2, sequence_parallel=True))
    kept = search_run_layouts(w, A100, 4, actor_ok=ok)
    assert kept and not any(c.run_layout.pool_of("actor").sequence_parallel for c in kept)
