"""Exact resume of a mixture of experts under tensor x expert parallelism: `rl3d train` of the MoE
quickstart on 4 gloo ranks, 4 GRPO steps straight against 2 steps, a restart that resumes from
step 2's checkpoint and 2 more, in two layouts:

- tp 2 x dp 2 x ep 2 with sequence parallelism (`auto` turns it on for a MoE at tp > 1), t_g 1;
- tp 2, etp 1 x ep 2 x dp 2 (each expert whole on its rank, sequence parallel too), generating
  at t_g 2.

Both runs' metrics agree bit for bit at every step (the straight run went on from its live
weights, the resumed one from the checkpoint: model, optimizer, scheduler, data position and every
rank's RNG), and `rl3d export` of both runs' step-4 checkpoints gives the same tensors bit for bit.
The export is the trained model: `transformers` on it gives the logits of megatron's own
(layout-aware) load of the checkpoint into one rank within 1e-5."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_hf_export import assert_same_tensors, megatron_logits
from train_helpers import ROOT, assert_same_metrics, metrics_by_step, run_train, train_env

from rl3d.config import load_config
from rl3d.models.sequence_parallel import resolve_sequence_parallel
from rl3d.models.spec import spec_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = ROOT / "recipes/quickstart_cpu_moe_grpo.yaml"
RUN = ("checkpoint.save_every=2", "launch.nproc_per_node=4", "hybrid_engine.timeout_s=120")
LAYOUTS = {
    "tp2-ep2-sp": ("actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2}", "rollout.t_g=1"),
    "tp2-etp1-ep2-tg2": ("actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2, etp: 1}", "rollout.t_g=2"),
}


def export(run_dir, dst, step):
    cmd = [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), "--dst", str(dst), "--step", str(step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=train_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dst


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_moe_run_resumes_exactly(layout, tmp_path):
    overrides = (*RUN, *LAYOUTS[layout])
    cfg = load_config(RECIPE, list(overrides)).config
    par = cfg.actor.parallel
    assert resolve_sequence_parallel(par.sequence_parallel, is_moe=spec_of(cfg.model).is_moe, tp=par.tp)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_train(RECIPE, straight, "trainer.total_steps=4", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(RECIPE, resumed, "trainer.total_steps=2", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(RECIPE, resumed, "trainer.total_steps=4", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "(step 2)" in proc.stderr, proc.stderr[-3000:]

    a, b = metrics_by_step(straight), metrics_by_step(resumed)
    assert sorted(a) == [1, 2, 3, 4]
    assert_same_metrics(a, b, exact=True)
    assert all(a[s]["reshard/bytes"] > 0 and a[s]["actor/grad_norm"] > 0 for s in a)

    out_a = export(straight, tmp_path / "export-straight", 4)
    out_b = export(resumed, tmp_path / "export-resumed", 4)
    assert_same_tensors(out_a, out_b)
    first = load_file(export(straight, tmp_path / "export-step2", 2) / "model.safetensors")
    last = load_file(out_a / "model.safetensors")
    experts = [n for n in last if ".experts." in n]
    assert experts and any(not torch.equal(first[n], last[n]) for n in experts)  # steps 3-4 trained them

    from transformers import AutoModelForCausalLM

    from rl3d.testing.spawn import run_distributed

    ids = torch.randint(0, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    ckpt = resumed / "checkpoints/step_00000004/actor"
    (ours,) = run_distributed(megatron_logits, 1, str(out_b), str(ckpt), ids, timeout_s=300)
    hf = AutoModelForCausalLM.from_pretrained(str(out_b)).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{layout}: transformers(export) vs megatron(checkpoint) logits: max |diff| = {diff:.3g}")
    assert diff < 1e-5, diff
