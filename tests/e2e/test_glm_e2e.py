"""GLM-4.5 end to end: the MoE quickstart on a tiny random GLM-4.5 (a dense first layer, a sigmoid
router with its expert bias) at DP 2 x EP 2, with routing replay of the rollout's routing and the
auxiliary-loss-free bias update on, 3 GRPO steps: each step's reshard moves the planner's bytes,
the rollout engine's log-probs equal the trainer's (so the bias each update moved reached the
engine), the bias moves, and `rl3d export` writes it back under HF's name."""

import subprocess
import sys

import pytest
from train_helpers import ROOT, metrics_by_step, run_train, train_env

from rl3d.config import load_config
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = ROOT / "recipes/quickstart_cpu_moe_grpo.yaml"
STEPS = 3
RATE = 0.01


def test_glm_grpo_run_with_replay_and_bias_update(tmp_path):
    from safetensors.torch import load_file

    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path / "tiny-glm4-moe"
    save_tiny_hf_model("tiny-glm4-moe", hf_dir, seed=3)
    run_dir = tmp_path / "run"
    overrides = [
        "model.name=null",
        f"model.hf_path={hf_dir}",
        "algorithm.routing_replay=rollout",
        f"actor.moe.expert_bias_update_rate={RATE}",
        f"trainer.total_steps={STEPS}",
        f"checkpoint.save_every={STEPS}",
    ]
    proc = run_train(RECIPE, run_dir, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    cfg = load_config(RECIPE, overrides).config
    planned = plan_transition(
        get_model_spec("tiny-glm4-moe"), ParallelLayout(1, 1, 2, ep=2), 1, dtype=cfg.model.dtype
    )
    planned = planned.strategies["hybridflow"]
    for step, m in steps.items():
        assert m["reshard/bytes"] == planned.comm_bytes_max > 0, step
        assert m["moe/routing_mismatch"] <= 0.01, step
        assert m["rollout/logp_diff_max"] < 1e-5, step
        assert m["moe/dropped_tokens"] == 0.0
        assert m["moe/expert_bias_abs_max"] > 0
    dst = tmp_path / "export"
    cmd = [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), "--dst", str(dst)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=train_env())
    assert out.returncode == 0, out.stderr[-3000:]
    exported = load_file(str(dst / "model.safetensors"))
    initial = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(exported) == sorted(initial)
    biases = [n for n in initial if n.endswith("e_score_correction_bias")]
    assert len(biases) == 3
    updates = (
        STEPS * cfg.data.prompts_per_step * cfg.rollout.n // cfg.actor.mini_batch_size
    )  # optimizer steps
    for name in biases:  # each optimizer step moves every expert's bias by 0 or +-RATE
        moved = (exported[name] - initial[name]).abs() / RATE
        assert moved.max() > 0.5 and moved.max() <= updates + 1e-3, name
        assert (moved - moved.round()).abs().max() < 1e-3, name
    worst = max(m["rollout/logp_diff_max"] for m in steps.values())
    mismatch = max(m["moe/routing_mismatch"] for m in steps.values())
    print(
        f"logp_diff_max {worst:.2e}, routing_mismatch {mismatch}, bias moves up to {moved.max():.0f} x rate"
    )
