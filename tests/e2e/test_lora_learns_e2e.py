"""The LoRA demo (`recipes/quickstart_cpu_lora_grpo.yaml`: rank-8 adapters on every linear and
lm_head over a frozen tiny random Llama, GRPO at TP 2) learns the demo's task, as it ships.

docs/lora.md's sweep reached a last-20 mean reward of 0.937, 0.999 and 0.937 on seeds 1-3 (from
about 0.5 over the first 20 steps). One seed, the recipe's own (1, one of the two lowest), held
below what it reached: the first 20 steps at most 0.6, the last 20 at least 0.85."""

import math

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = ROOT / "recipes/quickstart_cpu_lora_grpo.yaml"
STEPS = 200  # the recipe's


def test_lora_quickstart_learns(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(RECIPE, run_dir, "trainer.seed=1", "checkpoint.save_every=0", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    rows = [steps[s] for s in sorted(steps)]
    assert len(rows) == STEPS
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    first = sum(r["reward/score_mean"] for r in rows[:20]) / 20
    last = sum(r["reward/score_mean"] for r in rows[-20:]) / 20
    assert first <= 0.6 and last >= 0.85, (first, last)
