"""Mixtures of experts at tensor (x expert) parallelism end to end: `rl3d train` on 4 gloo ranks
(TP 2 x DP 2 x EP 2, sequence parallelism on by `auto`), 3 GRPO steps with routing replay
(`rollout`, an fp32 engine), rollout included: each step reshards the TP- and EP-sharded
weights to the torch engine at t_g 1, which generates and records the routing the trainer
replays.

Each step's reshard moves exactly the planner's bytes, the trainer's own routers agree with the
engine's record (fp32 on both sides) and its log-probs with the engine's within 1e-5, no token
is dropped; the training checkpoint exports to the HF layout with every tensor finite. And PPO
with a MoE actor, critic and reference at TP 2 (2 ranks) runs its loop."""

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


def test_tp2_ep2_grpo_run_with_routing_replay(tmp_path):
    from safetensors.torch import load_file

    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", hf_dir, seed=3)
    run_dir = tmp_path / "run"
    overrides = [
        "model.name=null",
        f"model.hf_path={hf_dir}",
        "actor.parallel={pp: 1, tp: 2, dp: 2, ep: 2}",
        "launch.nproc_per_node=4",
        "algorithm.routing_replay=rollout",
        f"trainer.total_steps={STEPS}",
        f"checkpoint.save_every={STEPS}",
    ]
    proc = run_train(RECIPE, run_dir, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    cfg = load_config(RECIPE, overrides).config
    assert cfg.rollout.t_g == 1 and cfg.rollout.dtype in (None, cfg.model.dtype)  # one precision
    layout = ParallelLayout(1, 2, 2, ep=2)
    planned = plan_transition(get_model_spec("tiny-qwen3-moe"), layout, 1, dtype=cfg.model.dtype)
    planned = planned.strategies["hybridflow"]
    for step, m in steps.items():
        assert m["reshard/bytes"] == planned.comm_bytes_max > 0, step
        assert m["moe/routing_mismatch"] <= 0.01, step
        assert m["rollout/logp_diff_max"] < 1e-5, step
        assert m["moe/dropped_tokens"] == 0.0
        assert torch.isfinite(torch.tensor([m["actor/pg_loss"], m["actor/grad_norm"]])).all()
    dst = tmp_path / "export"
    cmd = [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), "--dst", str(dst)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=train_env())
    assert out.returncode == 0, out.stderr[-3000:]
    exported = load_file(str(dst / "model.safetensors"))
    initial = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(exported) == sorted(initial)
    assert all(torch.isfinite(t).all() for t in exported.values())
    assert any(not torch.equal(exported[n], initial[n]) for n in initial if ".experts." in n)


def test_ppo_with_a_moe_actor_critic_and_reference_at_tp2(tmp_path):
    """The PPO quickstart on tiny Qwen3-MoE at its TP 2 (actor, critic and reference colocated,
    each with sequence parallelism by `auto`, the critic's value head gathering the sequence):
    2 steps, every loss and value finite, the engine's log-probs the trainer's."""
    from train_helpers import PPO

    run_dir = tmp_path / "run"
    overrides = ["model.name=tiny-qwen3-moe", "trainer.total_steps=2", "checkpoint.save_every=0"]
    proc = run_train(PPO, run_dir, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_config(PPO, overrides).config
    assert cfg.actor.parallel.tp == cfg.critic.parallel.tp == 2
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        values = [m["critic/vf_loss"], m["critic/values_mean"], m["critic/grad_norm"], m["actor/pg_loss"]]
        assert torch.isfinite(torch.tensor(values)).all()
        assert m["rollout/logp_diff_max"] < 1e-5
        assert m["moe/dropped_tokens"] == 0.0
