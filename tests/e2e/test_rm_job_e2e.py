"""The reward-model job end to end, briefly: `rl3d train` on the RM recipe (torchrun, megatron
at tp=2, synthetic preference parquet) logs train and held-out metrics and writes a complete
checkpoint; a PPO recipe then loads it as `reward.model`, in its own pool of 2 DP ranks beside
the actor's 2, and scores every rollout with it."""

import importlib.util
import json

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

from rl3d.checkpoint.manifest import verify

pytestmark = pytest.mark.e2e

RM = ROOT / "recipes/quickstart_cpu_rm.yaml"
PPO_RM = ROOT / "recipes/quickstart_cpu_ppo_rm.yaml"


def test_rm_job_writes_metrics_and_a_checkpoint_that_ppo_loads(tmp_path):
    rm_dir = tmp_path / "rm"
    short = ["trainer.total_steps=6", "rm.eval_every=3", "data.synthetic.num_pairs=200", "rm.batch_size=32"]
    proc = run_train(RM, rm_dir, *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(rm_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert all(0 <= r["train/accuracy"] <= 1 and r["train/loss"] > 0 for r in rows.values())
    assert {s for s, r in rows.items() if "val/accuracy" in r} == {3, 6}
    assert (rm_dir / "data/parity_repeat_200_seed0.parquet").is_file()  # the pairs, as parquet
    step = rm_dir / "checkpoints/step_00000006"
    assert verify(step, checksums=True) is None  # whole, per its manifest
    weights = step / "reward_model"
    assert {"rl3d_meta.json", "value_head.safetensors", "mp_rank_00_000", "mp_rank_01_000"} <= {
        p.name for p in weights.iterdir()
    }
    meta = json.loads((weights / "reward_model.json").read_text())
    assert meta["objective"] == "reward" and meta["val/accuracy"] == rows[6]["val/accuracy"]
    assert (rm_dir / "rm_curve.csv").read_text().splitlines()[0] == "step,val_accuracy,val_margin,val_loss"

    ppo_dir = tmp_path / "ppo"
    own_pool = [
        "reward.model.colocate=false",
        "reward.model.parallel={tp: 1, dp: 2}",
        "launch.nproc_per_node=4",
    ]
    proc = run_train(PPO_RM, ppo_dir, "trainer.total_steps=2", f"reward.model.path={rm_dir}", *own_pool)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in metrics_by_step(ppo_dir).values():
        assert 0 <= row["reward/rule_mean"] <= 1  # the hidden rule, logged only
        # reward.model.rule_weight 0: the score the policy trains on is the model's alone
        assert row["reward/score_mean"] == pytest.approx(row["reward/model_mean"], abs=1e-5)


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_rm_job_runs_the_same_from_any_directory(tmp_path, where):
    """Started in the checkout, whose top-level folders share names with installed packages
    (kernels/, yaml/), or anywhere else, the ranks import the installed packages: transformers
    imports Hugging Face's `kernels` wherever it is installed (transformers 5.25 requires it)."""
    cwd = ROOT if where == "checkout" else tmp_path
    run_dir = tmp_path / "rm"
    proc = run_train(
        RM, run_dir, "trainer.total_steps=2", "rm.eval_every=2", "data.synthetic.num_pairs=64", cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(metrics_by_step(run_dir)) == [1, 2]
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not str(spec.origin).startswith(str(ROOT / "kernels"))
