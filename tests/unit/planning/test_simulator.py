"""The step simulator against hand-computed stage times and the transition cost model."""

import pytest

from rl3d.bench.modeled import Point, model_point
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.planning.devices import A100, H200, get_device
from rl3d.planning.simulator import generate_seconds, pass_seconds, simulate, transition_seconds
from rl3d.planning.workload import PoolLayout, RunLayout, Workload

LLAMA7 = get_model_spec("llama2-7b")
PPO = ("actor", "critic", "reference")


def colocated(layout, t_g=1, roles=PPO, p_g=1):
    return RunLayout(pools=(PoolLayout("actor", layout, roles),), t_g=t_g, p_g=p_g)


def test_decode_of_one_sequence_is_its_weights_and_kv_read_once_per_token():
    w = Workload(actor=LLAMA7, prompts=1, prompt_len=128, response_len=64)
    _, decode = generate_seconds(LLAMA7, 1, 1, 1, A100, w, kv_budget=1e12)
    n = LLAMA7.num_params()
    assert n == 6_738_415_616
    kv_per_token = 2 * 32 * 128 * 2 * 32  # K and V, 32 heads of 128, bf16, 32 layers
    read = n * 2 + (128 + 32) * kv_per_token  # weights + the cache at the mean context
    step = read / (2039e9 * 0.7) + 2e-3  # HBM at decode_hbm_eff, plus the per-step overhead
    assert decode == pytest.approx(64 * step, rel=1e-12)


def test_training_is_three_forwards_and_the_bubble_grows_with_pipeline_stages():
    w = Workload(actor=LLAMA7, prompts=64, micro_batch_size=1)
    flat = ParallelLayout(1, 1, 8)
    fwd = pass_seconds(LLAMA7, flat, A100, w, samples=64, backward=False)
    assert pass_seconds(LLAMA7, flat, A100, w, samples=64, backward=True) == pytest.approx(3 * fwd, rel=1e-12)
    tokens, ctx = 64 * 2048, 1024
    flops = tokens * (2 * LLAMA7.num_params() + 4 * 32 * 4096 * ctx)
    assert fwd == pytest.approx(flops / (8 * 312e12 * 0.45), rel=1e-12)
    # p=2 over the same 8 devices: 16 micro-batches per rank, a bubble of 1/16 (no TP traffic)
    piped = pass_seconds(LLAMA7, ParallelLayout(2, 1, 4), A100, w, samples=64, backward=False)
    assert piped == pytest.approx(fwd * (1 + 1 / 16), rel=1e-12)


def test_the_transition_is_the_modelled_benchmarks_hybridflow():
    bench = model_point(Point("llama2-7b", 8, 1, 2, 2, 1))["strategies"]["hybridflow"]["seconds"]
    assert transition_seconds(LLAMA7, ParallelLayout(1, 8, 2), 2, 1, A100, "bfloat16") == pytest.approx(
        bench, rel=1e-12
    )


def test_a_step_sums_its_stages_and_names_the_bottleneck():
    w = Workload(actor=LLAMA7, roles=PPO, prompts=256)
    est = simulate(w, colocated(ParallelLayout(1, 8, 2), t_g=2), A100)
    assert set(est.stages) == {
        "prefill",
        "decode",
        "old_logp",
        "values",
        "ref_logp",
        "update_critic",
        "update_actor",
        "reshard",
    }
    assert est.step_seconds == pytest.approx(sum(est.stages.values()), rel=1e-12)
    assert est.bottleneck == max(est.stages, key=est.stages.get) and est.fits
    assert est.throughput == pytest.approx(256 * 2048 / est.step_seconds, rel=1e-12)
    # H200: the same FLOP peak, 2.35x the HBM bandwidth: decode gets faster, training does not get slower
    h200 = simulate(w, colocated(ParallelLayout(1, 8, 2), t_g=2), H200)
    assert h200.stages["decode"] < est.stages["decode"] / 1.5


def test_memory_refuses_70b_ppo_on_one_node_and_admits_it_on_eight():
    spec = get_model_spec("llama2-70b")
    w = Workload(actor=spec, roles=PPO, prompts=256, distributed_optimizer=True, flash_attention=True)
    assert not simulate(w, colocated(ParallelLayout(1, 8, 1), t_g=8), A100).fits
    assert simulate(w, colocated(ParallelLayout(4, 8, 2), t_g=8), A100).fits


def test_a_separate_pool_overlaps_generation_only_when_staleness_allows():
    w = Workload(actor=LLAMA7, prompts=256)
    pools = (
        PoolLayout("actor", ParallelLayout(1, 8, 1), ("actor",)),
        PoolLayout("rollout", ParallelLayout(1, 2, 4), ("rollout",)),
    )
    sync = simulate(w, RunLayout(pools=pools), A100)
    ahead = simulate(w, RunLayout(pools=pools, max_staleness=1), A100)
    gen = sync.stages["prefill"] + sync.stages["decode"]
    assert sync.step_seconds == pytest.approx(sum(sync.stages.values()), rel=1e-12)
    assert ahead.step_seconds == pytest.approx(max(gen, sync.step_seconds - gen), rel=1e-12)
    assert sync.stages["reshard"] > 0  # the weight sync to the rollout pool


def test_unknown_device_names_the_known_ones():
    with pytest.raises(ValueError, match="a100, h100, h200"):
        get_device("v100")


def test_the_baselines_of_the_paper_comparison():
    from rl3d.planning.systems import SYSTEMS, paper_workload, zero3_pass

    w = paper_workload("ppo", "llama2-7b")
    out = {name: fn(w, 16, A100) for name, fn in SYSTEMS.items()}
    assert all(r is not None for r in out.values())
    # NeMo-Aligner's one layout for both phases is one of rl3d's colocated candidates
    assert out["rl3d"]["step_seconds"] <= out["nemo_aligner"]["step_seconds"]
    # ZeRO-3 on 16 devices over two nodes: a forward per micro-batch gathers the bf16 weights
    # over the node link shared by 8 devices (25 GB/s / 8), unless the compute is longer
    gather = 15 / 16 * LLAMA7.num_params() * 2 / (25e9 / 8) + A100.nccl.ring_seconds(16, 2)
    micro = 1024 / (16 * 2)
    assert zero3_pass(w, "actor", 16, A100, backward=False) == pytest.approx(micro * gather, rel=1e-12)


def test_the_flags_list_every_device_class():
    from rl3d.planning.devices import DEVICES
    from rl3d.planning.plan_args import DEVICE_NAMES

    assert DEVICE_NAMES == tuple(DEVICES)
