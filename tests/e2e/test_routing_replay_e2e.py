"""`algorithm.routing_replay` through `rl3d train` (the GRPO quickstart on tiny-qwen3-moe, DP 2).

`rollout` with an fp32 engine: the engine's record reaches the trainer, whose router agrees
with it (`moe/routing_mismatch` within near ties), and the log-probs agree within fp32
rounding. `old`: the update replays the old forward's record and reports its mismatch."""

import pytest
from train_helpers import GRPO, metrics_by_step, run_train

pytestmark = pytest.mark.slow

MOE = [
    "model.name=tiny-qwen3-moe",
    "model.dtype=float32",
    "actor.parallel={tp: 1, pp: 1, dp: 2}",
    "actor.recompute_old_logp=always",
    "trainer.total_steps=2",
    "checkpoint.save_every=0",
]


def test_rollout_replay_with_an_fp32_engine(tmp_path):
    proc = run_train(GRPO, tmp_path / "run", *MOE, "algorithm.routing_replay=rollout")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step, m in metrics_by_step(tmp_path / "run").items():
        assert 0.0 <= m["moe/routing_mismatch"] <= 0.01, (step, m["moe/routing_mismatch"])
        assert m["rollout/logp_diff_max"] < 1e-4, (step, m["rollout/logp_diff_max"])
        assert 0.0 <= m["moe/routing_mismatch_update"] <= 1.0


def test_old_replay_reports_the_update_mismatch(tmp_path):
    proc = run_train(GRPO, tmp_path / "run", *MOE, "algorithm.routing_replay=old")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for m in metrics_by_step(tmp_path / "run").values():
        assert "moe/routing_mismatch" not in m  # no engine record
        assert 0.0 <= m["moe/routing_mismatch_update"] <= 1.0
