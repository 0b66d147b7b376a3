"""The MoE quickstart end to end at EP 2 against EP 1: real torchrun on 2 gloo ranks (dp 2), the
same tiny Qwen3-MoE checkpoint, seed and 3 GRPO steps, rollout included (each step reshards to
the torch engine, which generates the step's samples), fp32.

Under EP 2 each rank trains 4 of every layer's 8 experts and the reshard brings it the other 4
over the EP group; under EP 1 every rank trains all 8 and the experts stay in place. Only where
each expert's matmuls run differs, so the runs sample the same tokens, score the same rewards
and end with the same weights within 1e-6 (the exported HF checkpoints compared tensor by
tensor); each step's reshard moves exactly the planner's bytes.

Adam's eps is 1e-5 (as in tests/distributed/models/test_moe_ep_dist.py): Adam divides each
update by sqrt(v) + eps, so for an element whose gradient is near zero the default 1e-8 scales
the fp32 rounding difference of that gradient (the two layouts sum an expert's gradient in
another order) by about lr / sqrt(v); with it these 3 steps ended 1.5e-6 apart.

And the recipe as it ships learns the demo's task on seeds 1-3 (`test_moe_quickstart_learns`)."""

import subprocess
import sys

import pytest
import torch
from train_helpers import ROOT, metrics_by_step, run_train, train_env

from rl3d.config import load_config
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = ROOT / "recipes/quickstart_cpu_moe_grpo.yaml"
STEPS = 3
TOL = 1e-6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    out = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", out, seed=3)
    return out


def train_and_export(hf_dir, tmp_path, ep):
    run_dir = tmp_path / f"ep{ep}"
    overrides = [
        "model.name=null",
        f"model.hf_path={hf_dir}",
        f"actor.parallel={{pp: 1, tp: 1, dp: 2, ep: {ep}}}",
        f"trainer.total_steps={STEPS}",
        f"checkpoint.save_every={STEPS}",
        "actor.optim.adam_eps=1e-5",
        "actor.optim.lr=1e-3",  # twice the recipe's: a larger step for the layouts to disagree on
    ]
    proc = run_train(RECIPE, run_dir, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dst = tmp_path / f"export-ep{ep}"
    cmd = [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), "--dst", str(dst)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=train_env())
    assert out.returncode == 0, out.stderr[-3000:]
    from safetensors.torch import load_file

    return metrics_by_step(run_dir), load_file(str(dst / "model.safetensors")), overrides


def test_ep2_grpo_run_equals_ep1(hf_dir, tmp_path):
    m1, w1, _ = train_and_export(hf_dir, tmp_path, ep=1)
    m2, w2, overrides2 = train_and_export(hf_dir, tmp_path, ep=2)
    from safetensors.torch import load_file

    initial = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(m1) == sorted(m2) == list(range(1, STEPS + 1))
    assert sorted(w1) == sorted(w2) == sorted(initial)
    diff = max((w1[n] - w2[n]).abs().max().item() for n in w1)
    experts = [n for n in w1 if ".experts." in n]
    moved = sum((w1[n] - initial[n]).abs().max().item() > 100 * TOL for n in experts) / len(experts)
    print(f"max |EP2 - EP1| after {STEPS} GRPO steps: {diff:.2e}; expert tensors trained: {moved:.0%}")
    assert moved >= 0.9  # the routed experts trained (an expert no token reached keeps its weights)
    assert diff <= TOL, diff
    cfg = load_config(RECIPE, overrides2).config
    spec, layout = get_model_spec("tiny-qwen3-moe"), ParallelLayout(1, 1, 2, ep=2)
    planned = plan_transition(spec, layout, 1, dtype=cfg.model.dtype, strategies=("hybridflow",))
    planned = planned.strategies["hybridflow"]
    assert cfg.rollout.t_g == 1
    for step in m1:
        # the same tokens sampled and scored: the rollout saw (almost) the same policy
        assert m1[step]["reward/score_mean"] == m2[step]["reward/score_mean"], step
        assert m1[step]["reshard/bytes"] == 0  # EP 1 at t_g = t: identity, nothing moves
        assert m2[step]["reshard/bytes"] == planned.comm_bytes_max > 0  # the other rank's experts
        assert m2[step]["rollout/logp_diff_max"] < 1e-5
    assert torch.isfinite(torch.tensor([m2[s]["actor/pg_loss"] for s in m2])).all()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_moe_quickstart_learns(seed, tmp_path):
    """The recipe as it ships, on the three seeds of its sweep (docs/moe.md): mean reward over
    the first 20 steps <= 0.6, over the last 20 >= 0.9, under 5 minutes of training on 2 cores."""
    run_dir = tmp_path / "run"
    proc = run_train(RECIPE, run_dir, f"trainer.seed={seed}", "checkpoint.save_every=0", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    rows = [steps[s] for s in sorted(steps)]
    assert len(rows) == 300
    first = sum(r["reward/score_mean"] for r in rows[:20]) / 20
    last = sum(r["reward/score_mean"] for r in rows[-20:]) / 20
    assert first <= 0.6 and last >= 0.9, (first, last)
    assert sum(r["time/step"] for r in rows) < 300
