"""The CPU device class: its fixed costs fitted from microbenchmark rows, and what the
simulator charges for them. No timing: the rows are built from known costs."""

import pytest
import torch

from rl3d.bench.modeled import ADAM_BYTES_PER_PARAM
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.planning.calibration import KINDS, cpu_device, fit_fixed, nonnegative_lstsq
from rl3d.planning.devices import A100, FixedCosts
from rl3d.planning.simulator import pass_seconds, ring_allreduce_seconds, simulate
from rl3d.planning.workload import Placement, PoolPlacement, Workload

TINY = get_model_spec("tiny-llama")
TRUE = {
    "call_s": 3e-3, "call_layer_s": 2e-3, "micro_s": 1.5e-3, "layer_s": 1e-3,
    "train_call_s": 5e-3, "train_call_layer_s": 4e-3, "train_micro_s": 3e-3, "train_layer_s": 2.5e-3,
    "optim_step_s": 6e-3, "gen_call_s": 1e-3, "step_overhead_s": 4e-4, "decode_layer_s": 3e-4,
}  # fmt: skip
GFLOPS = 50.0


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
        for k in (1, 4, 8):
            counts = {"gen_call_s": 1, "step_overhead_s": k, "decode_layer_s": (k + 1) * layers}
            rows.append({"kind": "generate", "counts": counts, "flops": 2e5 * k})
    for r in rows:
        r["seconds"] = sum(n * costs[c] for c, n in r["counts"].items()) + r["flops"] / (GFLOPS * 1e9)
    return rows


def calibration(costs=TRUE) -> dict:
    return {"matmul_gflops": GFLOPS, "copy_gbps": 10.0, "gloo_alpha_us": 80.0, "gloo_gbps": 2.0,
            "gather_cpu_us": 500.0, "rows": rows_from(costs)}  # fmt: skip


def test_the_fit_recovers_the_costs_that_made_the_rows():
    fitted = fit_fixed(rows_from(TRUE), GFLOPS * 1e9)
    assert set(fitted) == {c for names in KINDS.values() for c in names}
    for name, value in TRUE.items():
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
    assert device.hbm_gbps == 10.0 and device.nvlink_gbps == 2.0
    assert device.step_overhead_s == pytest.approx(TRUE["step_overhead_s"])
    assert device.fixed.call_s == pytest.approx(TRUE["call_s"] + 500e-6)
    assert device.fixed.train_call_s == pytest.approx(TRUE["train_call_s"] + 500e-6)
    assert device.fixed.gen_call_s == pytest.approx(TRUE["gen_call_s"] + 500e-6)
    assert device.fixed.layer_s == pytest.approx(TRUE["layer_s"])
    # a 2-rank gloo call costs the fitted alpha: the latency model's base plus one hop
    assert device.nccl.ring_seconds(2, 1) == pytest.approx(80e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("gather_cpu_us"), "lacks"),
        (
            lambda c: c.update(rows=[r for r in c["rows"] if r["kind"] != "generate"][:-1] + c["rows"][-2:]),
            "rows",
        ),
        (lambda c: c["rows"][0]["counts"].update(mystery=1), "unknown costs"),
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
    for layout, micro in ((ParallelLayout(1, 1, 1), 4), (ParallelLayout(1, 1, 2), 2)):
        bare = pass_seconds(TINY, layout, A100, w, samples=32, backward=False)  # no fixed costs on a GPU
        compute = bare * A100.flops * A100.train_mfu / device.flops  # the same FLOPs on the CPU's rate
        fwd = pass_seconds(TINY, layout, device, w, samples=32, backward=False)
        assert fwd == pytest.approx(compute + micro * (fixed.micro_s + L * fixed.layer_s), rel=1e-9)
        bwd = pass_seconds(TINY, layout, device, w, samples=32, backward=True)
        assert bwd == pytest.approx(
            3 * compute + micro * (fixed.train_micro_s + L * fixed.train_layer_s), rel=1e-9
        )
        est = simulate(w, Placement(pools=(PoolPlacement("actor", layout, w.roles),)), device)
        call = fixed.call_s + L * fixed.call_layer_s
        assert est.stages["ref_logp"] == pytest.approx(call + fwd, rel=1e-9)
        steps, shard = 32 // 16, TINY.num_params()  # optimizer steps; no TP or PP: the whole model
        grads = ring_allreduce_seconds(shard * 4, layout.d, layout.d, device)  # fp32 over the DP group
        adam = shard * ADAM_BYTES_PER_PARAM / (device.hbm_gbps * 1e9)
        train_call = fixed.train_call_s + L * fixed.train_call_layer_s
        expected = train_call + bwd + steps * (grads + adam + fixed.optim_step_s)
        assert est.stages["update_actor"] == pytest.approx(expected, rel=1e-9)


def test_the_gpu_classes_pay_no_fixed_costs():
    assert A100.fixed == FixedCosts()
