"""SGLang sizes its own KV pool at launch: B x `mem_fraction_static` - its weights - its CUDA
graphs, B the free memory then (every role's static bytes already there, Adam's state included),
capped by `max_total_tokens`. The plan models that min, on a GPU adds what no tensor counts
(contexts, NCCL, fragmentation), and can say no both ways: a pool so large that the generate
phase does not fit, and a pool that holds no full-length sequence."""

import pytest

from rl3d.cli import main
from rl3d.config import load_config
from rl3d.launch.preflight_memory import MemoryPlanError, check_memory
from rl3d.planning import plan_memory
from rl3d.planning.memory_generate import CUDA_CONTEXT_BYTES

RECIPE = "recipes/gpu_llama2_7b_ppo.yaml"
GIB = 1 << 30
H100 = 79.1  # GiB: what an 80 GB card reports
UNCAPPED = "rollout.sglang.max_total_tokens=null"


def _engine(overrides: list[str], gib: float = H100):
    plan = plan_memory(load_config(RECIPE, overrides).config, int(gib * GIB))
    return plan, plan.worst().phases["generate"]["engine"]


def test_the_recipe_fits_an_80gb_card_as_it_reports_itself():
    plan, _ = _engine([])
    assert plan.fits
    device = plan.worst().phases["generate"]["device"]
    assert device.contexts == 2 * CUDA_CONTEXT_BYTES  # the trainer's and SGLang's scheduler's
    assert device.nccl > 0 and device.fragmentation > 0


def test_uncapped_pool_grows_with_mem_fraction_static_until_the_phase_no_longer_fits():
    pools, fits = [], []
    for fraction in (0.5, 0.7, 0.85, 0.95):
        plan, engine = _engine([UNCAPPED, f"rollout.sglang.mem_fraction_static={fraction}"])
        pools.append(engine.kv_cache)
        fits.append(plan.fits)
    assert pools == sorted(pools) and pools[0] < pools[-1]
    assert fits[0] and not fits[-1]  # 0.95 leaves too little beside the pool: refused


def test_too_high_fraction_is_refused_by_rl3d_plan_and_fits_with_the_plans_cap(capsys):
    high = "rollout.sglang.mem_fraction_static=0.95"
    assert main(["plan", RECIPE, UNCAPPED, high, "--memory", "--device-gib", str(H100)]) == 0
    out = capsys.readouterr().out
    assert f"fits {H100:.2f} GiB: no" in out and "generate phase" in out and "engine kv_cache" in out
    assert "rollout.sglang.max_total_tokens" in out and "mem_fraction_static" in out  # the remedies
    capped, engine = _engine([high])  # max_total_tokens: plan, the recipe's own setting
    assert capped.fits and engine.kv_cache < _engine([UNCAPPED, high])[1].kv_cache


def test_a_set_cap_bounds_the_pool():
    _, uncapped = _engine([UNCAPPED])
    _, small = _engine(["rollout.sglang.max_total_tokens=4096"])
    _, twice = _engine(["rollout.sglang.max_total_tokens=8192"])
    assert 0 < small.kv_cache and twice.kv_cache == 2 * small.kv_cache < uncapped.kv_cache


def test_too_low_fraction_holds_no_sequence_and_preflight_names_the_key():
    loaded = load_config(RECIPE, ["rollout.sglang.mem_fraction_static=0.2"])
    plan = plan_memory(loaded.config, int(H100 * GIB))
    assert plan.fits is False and all(r.peak_bytes <= plan.device_bytes for r in plan.ranks)
    assert "under one full-length sequence" in plan.worst().problems[0]
    with pytest.raises(MemoryPlanError) as err:
        check_memory(loaded, device_gib=H100)
    assert err.value.key == "rollout.sglang.mem_fraction_static" and "holds" in str(err.value)
