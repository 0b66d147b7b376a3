"""Rollout correction and the on-policy shortcut in the whole loop (GRPO quickstart)."""

import pytest
from train_helpers import GRPO, TIMING, TIMING_KEYS, metrics_by_step, run_train

pytestmark = pytest.mark.e2e

ONE_UPDATE = ("trainer.total_steps=5", "checkpoint.save_every=0", "actor.mini_batch_size=32")


def test_on_policy_shortcut_equals_recomputing_old_logprobs(tmp_path):
    """One optimizer update per step (mini-batch = the step's 32 samples): `auto` skips the old
    log-prob forward and gives the `always` run's losses and metrics after 5 steps."""
    runs = {}
    for mode in ("always", "auto"):
        proc = run_train(GRPO, tmp_path / mode, *ONE_UPDATE, f"actor.recompute_old_logp={mode}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = metrics_by_step(tmp_path / mode)
    always, auto = runs["always"], runs["auto"]
    for step in always:
        assert "time/old_logp" in always[step] and "time/old_logp" not in auto[step]
        shared = {k for k in auto[step] if not k.startswith(TIMING) and k not in TIMING_KEYS}
        assert shared - set(always[step]) == set()
        for key in sorted(shared):
            a, b = always[step][key], auto[step][key]
            assert b == (a if isinstance(a, str) else pytest.approx(a, rel=1e-6, abs=1e-6)), (step, key, a, b)
    mean = lambda run, key: sum(r[key] for r in run.values()) / len(run)  # noqa: E731
    old_logp_s = mean(always, "time/old_logp")
    print(  # noqa: T201
        f"step time: always {mean(always, 'time/step'):.3f} s (old_logp {old_logp_s:.3f} s), "
        f"auto {mean(auto, 'time/step'):.3f} s"
    )


def test_bf16_rollouts_against_the_fp32_trainer_with_tis(tmp_path):
    """A bf16 torch engine makes a real mismatch; TIS weights it and reports how much."""
    run = tmp_path / "tis"
    proc = run_train(
        GRPO,
        run,
        "trainer.total_steps=2",
        "checkpoint.save_every=0",
        "rollout.dtype=bfloat16",
        "algorithm.rollout_correction.mode=tis",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in metrics_by_step(run).values():
        assert row["rollout/logp_diff_max"] > 1e-3  # bf16 vs fp32: far above fp32's 1e-6
        assert row["rollout/kl_k3"] > 0
        assert 0 < row["rollout_corr/weight_mean"] <= 2.0 and row["rollout_corr/weight_max"] <= 2.0
        assert 0.0 <= row["rollout_corr/clipped_frac"] <= 1.0 and row["rollout_corr/masked_frac"] == 0.0


def test_bf16_trainer_and_engine_agree_to_bf16_precision(tmp_path):
    """A bf16 model end to end on CPU (megatron keeps its norms in fp32 without TE; the transition
    casts them): it trains, and the engine's log-probs stay within bf16's reach of the trainer's.
    Stated tolerance 2e-2, measured 2.0e-3 and 2.8e-3."""
    run = tmp_path / "bf16"
    proc = run_train(GRPO, run, "trainer.total_steps=2", "checkpoint.save_every=0", "model.dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert 0 < row["rollout/logp_diff_max"] < 2e-2
        assert row["actor/grad_norm"] > 0
