"""The learned-reward chain learns (slow): preference pairs labelled by a hidden rule -> a
reward (or cost) model -> RL against that model moves the rule, which RL never saw directly."""

import json
import statistics

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _window(rows, key, part):
    values = [r[key] for r in rows]
    return statistics.mean(values[:20] if part == "first" else values[-20:])


def test_ppo_against_the_learned_reward_model_raises_the_hidden_rule(tmp_path):
    """RM held-out pair accuracy >= 0.9; PPO (120 steps, seed 1) raises parity_repeat's mean by
    >= 0.2 from its first 20 steps to its last 20 (150 steps of 3 seeds: 0.51-0.53 -> 0.93-0.97,
    benchmarks/rm)."""
    rm_dir = tmp_path / "rm"
    proc = run_train(ROOT / "recipes/quickstart_cpu_rm.yaml", rm_dir, "trainer.total_steps=150")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((rm_dir / "rm_summary.json").read_text())["val/accuracy"] >= 0.9
    ppo_dir = tmp_path / "ppo"
    recipe = ROOT / "recipes/quickstart_cpu_ppo_rm.yaml"
    proc = run_train(recipe, ppo_dir, f"reward.model.path={rm_dir}", "trainer.total_steps=120")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [metrics_by_step(ppo_dir)[s] for s in range(1, 121)]
    first, last = _window(rows, "reward/rule_mean", "first"), _window(rows, "reward/rule_mean", "last")
    assert last - first >= 0.2, (first, last)


def test_safe_rlhf_with_a_learned_cost_model_meets_the_hidden_constraint(tmp_path):
    """The cost model learns high_token_ids (unsafe above 0.25); Safe-RLHF against it (threshold
    0 in the model's units) brings the rule's mean cost (random policy ~0.45) under 0.25 while
    the reward (parity_repeat) does not collapse."""
    cm_dir = tmp_path / "cm"
    proc = run_train(ROOT / "recipes/quickstart_cpu_cm.yaml", cm_dir, "trainer.total_steps=100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((cm_dir / "rm_summary.json").read_text())["val/accuracy"] >= 0.9
    run_dir = tmp_path / "safe"
    recipe = ROOT / "recipes/quickstart_cpu_safe_rlhf_cm.yaml"
    proc = run_train(recipe, run_dir, f"reward.cost_model.path={cm_dir}", "trainer.total_steps=100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [metrics_by_step(run_dir)[s] for s in range(1, 101)]
    cost_first, cost_last = _window(rows, "cost/rule_mean", "first"), _window(rows, "cost/rule_mean", "last")
    assert cost_first > 0.3 and cost_last < 0.25, (cost_first, cost_last)
    reward_first, reward_last = (
        _window(rows, "reward/score_mean", "first"),
        _window(rows, "reward/score_mean", "last"),
    )
    assert reward_last >= reward_first - 0.1, (reward_first, reward_last)
    assert max(r["safe/lambda"] for r in rows) > 1.0  # raised while the model's cost was above 0
