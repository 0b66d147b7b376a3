"""The CPU device class: its fixed costs fitted from microbenchmark rows, and what the
simulator charges for them. No timing: the rows are built from known costs."""

from dataclasses import replace

import pytest
import torch

from rl3d.costs.optimizer import ADAM_BYTES_PER_PARAM
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.planning.calibration import (
    KINDS,
    LATER_KINDS,
    cpu_device,
    fit_fixed,
    low_percentile,
    nonnegative_lstsq,
    wake_share,
)
from rl3d.planning.devices import A100, FixedCosts
from rl3d.planning.simulator import pass_seconds, ring_allreduce_seconds, simulate, woken_stages
from rl3d.planning.workload import PoolLayout, RunLayout, Workload

TINY = get_model_spec("tiny-llama")
TRUE = {
    "call_s": 3e-3, "call_layer_s": 2e-3, "micro_s": 1.5e-3, "layer_s": 1e-3,
    "train_call_s": 5e-3, "train_call_layer_s": 4e-3, "train_micro_s": 3e-3, "train_layer_s": 2.5e-3,
    "optim_step_s": 6e-3, "gen_call_s": 1e-3, "step_overhead_s": 4e-4, "decode_layer_s": 3e-4,
    "tp_micro_s": 2e-3, "train_tp_micro_s": 3.5e-3, "train_tp_step_s": 7e-3, "score_sample_s": 1e-4,
    "control_step_s": 5e-3, "control_sample_s": 8e-5, "critic_micro_s": 0.5e-3, "critic_layer_s": 0.7e-3,
    "critic_train_micro_s": 1e-3, "critic_train_layer_s": 1.8e-3, "critic_tp_micro_s": 1.2e-3,
    "critic_train_tp_micro_s": 2.5e-3, "handover_s": 2e-3, "handover_wait_share": 0.05, "critic_call_s": 1e-3,
    "critic_call_layer_s": 1.5e-3, "critic_train_call_s": 2e-3, "critic_train_call_layer_s": 3e-3,
    "critic_optim_step_s": 4e-3,
}  # fmt: skip
WAKE_SHARE = 0.2
GFLOPS, GLOO_CALL_US, GLOO_GBPS = 50.0, 150.0, 2.0


def allreduce_s(nbytes: float) -> float:
    return GLOO_CALL_US * 1e-6 + nbytes / (GLOO_GBPS * 1e9)


def rows_from(costs: dict[str, float]) -> list[dict]:
    """Rows shaped as benchmarks/simulator_microbench.py writes them, timed by `costs` exactly."""
    rows = []
    for layers in (1, 2):
        for k in (1, 2, 4):
            counts = {"call_s": 1, "call_layer_s": layers, "micro_s": k, "layer_s": k * layers}
            rows.append({"kind": "forward", "counts": counts, "flops": 1e6 * k})
        for k, steps in ((1, 1), (4, 1), (4, 2), (4, 4)):
            counts = {"train_call_s": 1, "train_call_layer_s": layers, "train_micro_s": k,
                      "train_layer_s": k * layers, "optim_step_s": steps}  # fmt: skip
            rows.append({"kind": "train", "counts": counts, "flops": 3e6 * k})
        for k in (1, 2, 4):  # the critic's: its own worker call, micro-batch and layer costs
            counts = {"critic_call_s": 1, "critic_call_layer_s": layers, "critic_micro_s": k,
                      "critic_layer_s": k * layers}  # fmt: skip
            rows.append({"kind": "critic_forward", "counts": counts, "flops": 1e6 * k})
        for k, steps in ((1, 1), (4, 1), (4, 2), (4, 4)):
            counts = {"critic_train_call_s": 1, "critic_train_call_layer_s": layers,
                      "critic_train_micro_s": k, "critic_train_layer_s": k * layers,
                      "critic_optim_step_s": steps}  # fmt: skip
            rows.append({"kind": "critic_train", "counts": counts, "flops": 3e6 * k})
        for k in (1, 4, 8):
            counts = {"gen_call_s": 1, "step_overhead_s": k, "decode_layer_s": (k + 1) * layers}
            rows.append({"kind": "generate", "counts": counts, "flops": 2e5 * k})
    rows += [{"kind": "score", "counts": {"score_sample_s": n}, "flops": 0.0} for n in (16, 8)]
    for n in (32, 16, 8):  # a whole step's rollout on one rank: the engine, the reward, the controller
        counts = {"gen_call_s": 1, "step_overhead_s": 8, "decode_layer_s": 9 * 2, "score_sample_s": n,
                  "control_step_s": 1, "control_sample_s": n}  # fmt: skip
        rows.append({"kind": "generate_stage", "counts": counts, "flops": 2e5 * n})
        # with a separate pool: its generation, the trainer's wait for the rows (wall s) and their hand-over
        counts = counts | {"handover_s": 1, "handover_wait_share": 0.004 * n}
        rows.append({"kind": "generate_separate", "counts": counts, "flops": 2e5 * n})
    for n, again in ((32, 0.03), (16, 0.016)):  # the actor's forward right after that wait, and at once
        woken = again * (1 + WAKE_SHARE)
        rows.append({"kind": "forward_after_wait", "counts": {}, "samples": n, "seconds": woken})
        rows.append({"kind": "forward_again", "counts": {}, "samples": n, "seconds": again})
    trained = ("forward", "train", "critic_forward", "critic_train")
    for r in [r for r in rows if r["kind"] in trained]:  # the same at tensor parallelism 2
        tp = {"kind": r["kind"] + "_tp", "counts": dict(r["counts"]), "flops": r["flops"] / 2}
        pre = "critic_" if r["kind"].startswith("critic_") else ""
        forward = r["kind"].endswith("forward")
        k = r["counts"][f"{pre}micro_s" if forward else f"{pre}train_micro_s"]
        layers = r["counts"][f"{pre}call_layer_s" if forward else f"{pre}train_call_layer_s"]
        if forward:
            tp["counts"][f"{pre}tp_micro_s"] = k
        else:
            tp["counts"] |= {
                f"{pre}train_tp_micro_s": k,
                "train_tp_step_s": r["counts"][f"{pre}optim_step_s"],
            }
        per_layer = 2 if forward else 4
        rows.append(tp | {"allreduces": k * per_layer * layers, "allreduce_bytes": 8 * 24 * 64 * 4})
    for r in [r for r in rows if "seconds" not in r]:
        r["seconds"] = sum(n * costs[c] for c, n in r["counts"].items()) + r.get("flops", 0) / (GFLOPS * 1e9)
        r["seconds"] += r.get("allreduces", 0) * allreduce_s(r.get("allreduce_bytes", 0))
    return rows


def calibration(costs=TRUE) -> dict:
    return {"matmul_gflops": GFLOPS, "copy_gbps": 10.0, "gloo_call_cpu_us": GLOO_CALL_US,
            "gloo_gbps": GLOO_GBPS, "gather_cpu_us": 500.0, "gather_rollout_cpu_us": 900.0,
            "rows": rows_from(costs)}  # fmt: skip


def test_the_fit_recovers_the_costs_that_made_the_rows():
    fitted = fit_fixed(rows_from(TRUE), GFLOPS * 1e9, allreduce_s)
    assert set(fitted) == {c for names in (*KINDS.values(), *LATER_KINDS.values()) for c in names} | {
        "wake_share"
    }
    for name, value in (TRUE | {"wake_share": WAKE_SHARE}).items():
        assert fitted[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_a_cost_the_rows_do_not_pay_for_is_pinned_at_zero_not_negative():
    A = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = torch.tensor([3.0, 2.0, 1.0])  # unconstrained: 4 - x, a negative slope
    x = nonnegative_lstsq(A, b)
    assert x.tolist() == pytest.approx([2.0, 0.0])  # the mean, with the slope pinned at 0


def test_the_cpu_class_takes_the_measured_rates_and_adds_the_gather_to_every_call():
    device = cpu_device(calibration())
    assert device.flops == pytest.approx(GFLOPS * 1e9)
    assert (device.train_mfu, device.prefill_mfu, device.decode_hbm_eff) == (1.0, 1.0, 1.0)
    assert device.hbm_gbps == 10.0 and device.nvlink_gbps == GLOO_GBPS
    assert device.step_overhead_s == pytest.approx(TRUE["step_overhead_s"])
    assert device.fixed.call_s == pytest.approx(TRUE["call_s"] + 500e-6)
    assert device.fixed.train_call_s == pytest.approx(TRUE["train_call_s"] + 500e-6)
    assert device.fixed.critic_call_s == pytest.approx(TRUE["critic_call_s"] + 500e-6)
    assert device.fixed.critic_train_call_s == pytest.approx(TRUE["critic_train_call_s"] + 500e-6)
    assert device.fixed.gen_call_s == pytest.approx(TRUE["gen_call_s"])
    assert device.fixed.gen_gather_s == pytest.approx(900e-6)  # the rollout rows' gather, on its own
    assert device.fixed.layer_s == pytest.approx(TRUE["layer_s"])
    # a 2-rank all-reduce costs what one gloo call costs a rank, plus its bytes at gloo's bandwidth
    assert ring_allreduce_seconds(1e6, 2, 2, device) == pytest.approx(allreduce_s(1e6))
    assert device.fixed.tp_micro_s == pytest.approx(TRUE["tp_micro_s"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("gather_cpu_us"), "lacks"),
        (
            lambda c: c.update(rows=[r for r in c["rows"] if r["kind"] != "generate"][:-1] + c["rows"][-2:]),
            "rows",
        ),
        (lambda c: c["rows"][0]["counts"].update(mystery=1), "unknown kind or costs"),
        (lambda c: c.update(matmul_gflops=0.0), "matmul"),
    ],
)
def test_a_broken_calibration_is_refused_with_what_is_wrong(change, message):
    c = calibration()
    change(c)
    with pytest.raises(ValueError, match=message):
        cpu_device(c)


def test_negative_fixed_costs_are_refused():
    with pytest.raises(ValueError, match="layer_s"):
        FixedCosts(layer_s=-1.0)


def test_the_simulator_charges_each_fixed_cost_per_its_unit():
    device = cpu_device(calibration())
    fixed, L = device.fixed, TINY.num_layers
    w = Workload(actor=TINY, roles=("actor", "reference"), prompts=16, samples_per_prompt=2, prompt_len=16,
                 response_len=8, micro_batch_size=8, mini_batch_size=16, dtype_bytes=4)  # fmt: skip
    flops = 32 * 24 * (2 * TINY.num_params() + 4 * L * 64 * 12)  # 32 sequences of 24 tokens, context 12
    for layout, micro in (
        (ParallelLayout(1, 1, 1), 4),
        (ParallelLayout(1, 1, 2), 2),
        (ParallelLayout(1, 2, 1), 4),
    ):
        t = layout.t > 1  # tensor parallelism: its per-micro-batch costs and the layers' all-reduces
        compute = flops / (layout.world_size * GFLOPS * 1e9)
        layer_ar = t * allreduce_s(8 * 24 * 64 * 4)  # a micro-batch's activations: 8 x 24 x 64, fp32
        fwd = pass_seconds(TINY, layout, device, w, samples=32, backward=False)
        own = fixed.micro_s + L * fixed.layer_s + t * fixed.tp_micro_s
        assert fwd == pytest.approx(compute + micro * (own + 2 * L * layer_ar), rel=1e-9)
        bwd = pass_seconds(TINY, layout, device, w, samples=32, backward=True)
        own = fixed.train_micro_s + L * fixed.train_layer_s + t * fixed.train_tp_micro_s
        assert bwd == pytest.approx(3 * compute + micro * (own + 4 * L * layer_ar), rel=1e-9)
        est = simulate(w, RunLayout(pools=(PoolLayout("actor", layout, w.roles),)), device)
        call = fixed.call_s + L * fixed.call_layer_s
        assert est.stages["ref_logp"] == pytest.approx(call + fwd, rel=1e-9)
        steps, shard = 32 // 16, TINY.num_params() / layout.t  # optimizer steps; the rank's parameters
        grads = ring_allreduce_seconds(shard * 4, layout.d, layout.d, device)  # fp32 over the DP group
        adam = shard * ADAM_BYTES_PER_PARAM / (device.hbm_gbps * 1e9)
        optim = fixed.optim_step_s + t * fixed.train_tp_step_s
        train_call = fixed.train_call_s + L * fixed.train_call_layer_s
        expected = train_call + bwd + steps * (grads + adam + optim)
        assert est.stages["update_actor"] == pytest.approx(expected, rel=1e-9)


def test_the_gpu_classes_pay_no_fixed_costs():
    assert A100.fixed == FixedCosts()


def test_the_controller_s_rollout_work_is_charged_per_step_and_sample_inside_generate():
    w = Workload(actor=TINY, prompts=8, samples_per_prompt=4, prompt_len=16, response_len=8)
    run_layout = RunLayout(pools=(PoolLayout("actor", ParallelLayout(1, 1, 2), w.roles),))
    est = simulate(w, run_layout, cpu_device(calibration()))
    assert est.stages["control"] == pytest.approx(TRUE["control_step_s"] + 32 * TRUE["control_sample_s"])
    assert est.stages["score"] == pytest.approx(32 * TRUE["score_sample_s"])
    assert "control" not in simulate(w, run_layout, A100).stages  # zero on a GPU class: not listed


def test_a_timing_is_the_low_percentile_of_its_repeats():
    assert low_percentile([5.0, 1.0, 3.0]) == pytest.approx(1.8)  # 20th: 1 + 0.4 x (3 - 1)
    assert low_percentile([2.0]) == 2.0
    assert low_percentile([4.0, 1.0, 2.0, 3.0, 9.0], q=0) == 1.0  # the least
    with pytest.raises(ValueError, match="without repeats"):
        low_percentile([])


def _ppo(layout: ParallelLayout):
    w = Workload(actor=TINY, roles=("actor", "critic", "cost_critic"), prompts=16, samples_per_prompt=2,
                 prompt_len=16, response_len=8, micro_batch_size=8, mini_batch_size=16,
                 dtype_bytes=4)  # fmt: skip
    return w, RunLayout(pools=(PoolLayout("actor", layout, w.roles),))


@pytest.mark.parametrize("layout", [ParallelLayout(1, 1, 2), ParallelLayout(1, 2, 1)])
def test_the_value_models_passes_pay_the_critic_s_costs_and_the_rest_the_actor_s(layout):
    device = cpu_device(calibration())
    fixed, L = device.fixed, TINY.num_layers
    w, run_layout = _ppo(layout)
    est = simulate(w, run_layout, device)
    actor_fwd = pass_seconds(TINY, layout, device, w, samples=32, backward=False)
    critic_fwd = pass_seconds(TINY, layout, device, w, samples=32, backward=False, critic=True)
    micro, t = 32 // layout.d // 8, layout.t > 1  # at t > 1 the critic's tensor-parallel costs too
    own = fixed.critic_micro_s + L * fixed.critic_layer_s + t * fixed.critic_tp_micro_s
    actor_own = fixed.micro_s + L * fixed.layer_s + t * fixed.tp_micro_s
    assert critic_fwd - actor_fwd == pytest.approx(micro * (own - actor_own), rel=1e-9)
    actor_bwd = pass_seconds(TINY, layout, device, w, samples=32, backward=True)
    critic_bwd = pass_seconds(TINY, layout, device, w, samples=32, backward=True, critic=True)
    own = fixed.critic_train_micro_s + L * fixed.critic_train_layer_s + t * fixed.critic_train_tp_micro_s
    actor_own = fixed.train_micro_s + L * fixed.train_layer_s + t * fixed.train_tp_micro_s
    assert critic_bwd - actor_bwd == pytest.approx(micro * (own - actor_own), rel=1e-9)
    # both value models (critic, cost_critic): the critic's calls and passes; the actor's stages: its own
    critic_call = fixed.critic_call_s + L * fixed.critic_call_layer_s
    assert est.stages["values"] == pytest.approx(2 * (critic_call + critic_fwd), rel=1e-9)
    assert est.stages["old_logp"] == pytest.approx(
        fixed.call_s + L * fixed.call_layer_s + actor_fwd, rel=1e-9
    )
    steps, tp_step = 32 // 16, t * fixed.train_tp_step_s  # optimizer steps a pass
    actor_rest = fixed.train_call_s + L * fixed.train_call_layer_s + steps * (fixed.optim_step_s + tp_step)
    critic_rest = (
        fixed.critic_train_call_s + L * fixed.critic_train_call_layer_s
        + steps * (fixed.critic_optim_step_s + tp_step)
    )  # fmt: skip
    # the same gradients and Adam bytes for both: what differs is the fixed costs
    assert est.stages["update_critic"] - 2 * (critic_bwd + critic_rest) == pytest.approx(
        2 * (est.stages["update_actor"] - actor_bwd - actor_rest), rel=1e-9
    )
    assert est.stages["values"] < 2 * est.stages["old_logp"]  # the critic's costs are the cheaper here


def test_a_calibration_without_the_critic_s_rows_charges_the_value_models_the_actor_s_costs():
    c = calibration()
    c["rows"] = [r for r in c["rows"] if not r["kind"].startswith("critic_")]
    fixed = cpu_device(c).fixed
    assert (fixed.critic_micro_s, fixed.critic_layer_s) == (fixed.micro_s, fixed.layer_s)
    assert (fixed.critic_call_s, fixed.critic_train_call_s) == (fixed.call_s, fixed.train_call_s)
    assert fixed.critic_optim_step_s == fixed.optim_step_s
    tp = (fixed.critic_tp_micro_s, fixed.critic_train_tp_micro_s)
    assert tp == (fixed.tp_micro_s, fixed.train_tp_micro_s)
    assert (fixed.critic_train_micro_s, fixed.critic_train_layer_s) == (
        fixed.train_micro_s,
        fixed.train_layer_s,
    )
    w, run_layout = _ppo(ParallelLayout(1, 1, 2))
    est = simulate(w, run_layout, cpu_device(c))
    assert est.stages["values"] == pytest.approx(2 * est.stages["old_logp"], rel=1e-12)
    assert est.stages["update_critic"] == pytest.approx(2 * est.stages["update_actor"], rel=1e-12)


def test_a_separate_pool_s_rows_are_handed_over_and_a_colocated_replica_s_gathered():
    device = cpu_device(calibration())
    fixed = device.fixed
    w = Workload(actor=TINY, prompts=8, samples_per_prompt=4, prompt_len=16, response_len=8)
    actor = PoolLayout("actor", ParallelLayout(1, 1, 2), w.roles)
    colocated = simulate(w, RunLayout(pools=(actor,)), device).stages
    rollout = PoolLayout("rollout", ParallelLayout(1, 1, 2), ("rollout",))
    separate = simulate(w, RunLayout(pools=(actor, rollout)), device).stages
    assert "handover" not in colocated
    # the same replicas generate; only the colocated ones' rows are gathered
    assert colocated["prefill"] - separate["prefill"] == pytest.approx(fixed.gen_gather_s, rel=1e-9)
    waited = separate["prefill"] + separate["decode"]  # the trainer polls while the pool generates
    assert separate["handover"] == pytest.approx(TRUE["handover_s"] + waited * TRUE["handover_wait_share"])
    assert "handover" not in simulate(w, RunLayout(pools=(actor, rollout)), A100).stages  # zero on a GPU


def test_a_calibration_without_a_separate_pool_s_rows_charges_no_hand_over():
    c = calibration()
    c["rows"] = [r for r in c["rows"] if r["kind"] not in ("generate_separate", "forward_after_wait")]
    fixed = cpu_device(c).fixed
    assert (fixed.handover_s, fixed.handover_wait_share, fixed.wake_share) == (0.0, 0.0, 0.0)


def _pools(w: Workload, *own: str, separate: bool = False) -> tuple[PoolLayout, ...]:
    """The actor's pool with every role not in `own`, a pool per role in `own`, a rollout pool."""
    lay = ParallelLayout(1, 1, 2)
    pools = [PoolLayout("actor", lay, tuple(r for r in w.roles if r not in own))]
    pools += [PoolLayout(r, lay, (r,)) for r in own]
    return (*pools, *([PoolLayout("rollout", lay, ("rollout",))] if separate else []))


@pytest.mark.parametrize(
    "own, separate, staleness, woken",
    [
        ((), False, 0, []),  # one pool: every stage follows its own
        ((), True, 0, ["old_logp"]),  # the trainer waited through the pool's generation
        ((), True, 1, []),  # the pool generated while the trainer worked
        (("reference",), False, 0, ["ref_logp", "update_critic"]),
        (("critic", "reference"), False, 0, ["values", "ref_logp", "update_critic", "update_actor"]),
    ],
)
def test_a_stage_whose_ranks_waited_for_another_pool_pays_the_wake_up(own, separate, staleness, woken):
    device = cpu_device(calibration())
    w = Workload(actor=TINY, roles=("actor", "critic", "reference"), prompts=8, samples_per_prompt=4,
                 prompt_len=16, response_len=8, micro_batch_size=8, mini_batch_size=16)  # fmt: skip
    run_layout = RunLayout(pools=_pools(w, *own, separate=separate), max_staleness=staleness)
    est = simulate(w, run_layout, device)
    assert woken_stages(w, run_layout, est.stages) == woken
    cold = simulate(w, run_layout, replace(device, fixed=replace(device.fixed, wake_share=0.0)))
    for stage, seconds in est.stages.items():
        assert seconds == pytest.approx(cold.stages[stage] * (1 + WAKE_SHARE if stage in woken else 1))


def test_the_wake_up_is_the_woken_forward_s_excess_and_never_negative():
    pairs = [("forward_after_wait", 33e-3), ("forward_again", 30e-3), ("forward_after_wait", 16e-3),
             ("forward_again", 15e-3)]  # fmt: skip
    rows = [{"kind": k, "samples": 32 if i < 2 else 16, "seconds": t} for i, (k, t) in enumerate(pairs)]
    # least squares through the origin: sum(woken x again) / sum(again^2) - 1
    assert wake_share(rows) == pytest.approx((33 * 30 + 16 * 15) / (30**2 + 15**2) - 1)
    faster = [r | {"seconds": r["seconds"] * (0.9 if r["kind"] == "forward_after_wait" else 1)} for r in rows]
    assert wake_share(faster) == 0.0
    assert wake_share([]) == 0.0
