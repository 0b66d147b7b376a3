"""LoRA with the engine keeping the base (`actor.lora.transition`): the LoRA quickstart (tp 2 ->
t_g 1, and pp 2 -> t_g 1, adapters on every linear) moves only the adapters each step, exactly the
planner's bytes,
and generates with the adapted policy: the engine's log-probs equal the trainer's, and the run
equals one that moves merged weights."""

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

from rl3d.config import load_config
from rl3d.hybrid_engine.lora_plan import plan_lora_transition
from rl3d.models.spec import spec_of
from rl3d.parallel import ParallelLayout

pytestmark = pytest.mark.e2e

LORA_GRPO = ROOT / "recipes" / "quickstart_cpu_lora_grpo.yaml"
# the adapters on the decoder layers only: an adapted lm_head reaches the engine merged
STEPS = ("trainer.total_steps=3", "checkpoint.save_every=0", "actor.lora.target_modules=[all-linear]")


def planned(overrides=()) -> tuple[int, int]:
    """(adapter, full model) bytes the busiest generation rank receives, as `rl3d plan` says."""
    cfg = load_config(LORA_GRPO, list(overrides)).config
    par, lora = cfg.actor.parallel, cfg.actor.lora
    t = plan_lora_transition(
        spec_of(cfg.model), ParallelLayout(par.pp, par.tp, par.dp), cfg.rollout.t_g,
        rank=lora.rank, targets=lora.targets, dtype=cfg.model.dtype,
    )  # fmt: skip
    return t.lora.strategies["hybridflow"].comm_bytes_max, t.full.strategies["hybridflow"].comm_bytes_max


PP2 = ("actor.parallel.tp=1", "actor.parallel.pp=2")  # each rank trains one layer's adapters


@pytest.mark.parametrize(
    ("engine_mode", "layout"),
    [
        ("merge", ()),
        pytest.param("apply", (), marks=pytest.mark.slow),
        pytest.param("merge", PP2, marks=pytest.mark.slow),
    ],
    ids=["merge", "apply", "merge-pp2"],
)
def test_only_adapters_move_and_the_engine_generates_the_adapted_policy(engine_mode, layout, tmp_path):
    overrides = [*STEPS, *layout, "actor.lora.transition=adapters", f"actor.lora.engine_mode={engine_mode}"]
    proc = run_train(LORA_GRPO, tmp_path / "run", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter_bytes, full_bytes = planned(overrides)
    assert 0 < adapter_bytes < full_bytes / 5  # 10.8x fewer at tp 2, 6.7x at pp 2 (rank 8, every linear)
    steps = metrics_by_step(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3]
    for row in steps.values():
        assert row["reshard/bytes"] == adapter_bytes
        # B starts at zero, so steps 2 and 3 generate with adapters that changed the policy;
        # fp32 engine against fp32 trainer: stated tolerance 1e-5
        assert row["rollout/logp_diff_max"] < 1e-5


@pytest.mark.slow
def test_adapter_transition_trains_as_the_merged_one(tmp_path):
    runs = {}
    for transition in ("adapters", "merged"):
        proc = run_train(LORA_GRPO, tmp_path / transition, *STEPS, f"actor.lora.transition={transition}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[transition] = metrics_by_step(tmp_path / transition)
    adapter_bytes, full_bytes = planned(STEPS)
    for step, row in runs["adapters"].items():
        merged = runs["merged"][step]
        assert (row["reshard/bytes"], merged["reshard/bytes"]) == (adapter_bytes, full_bytes)
        for key in ("actor/pg_loss", "reward/score_mean", "reward/score_std", "adv/mean"):
            assert row[key] == pytest.approx(merged[key], rel=1e-5, abs=1e-6), (step, key)
