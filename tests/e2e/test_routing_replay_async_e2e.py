"""`algorithm.routing_replay: rollout` with a separate rollout pool (`rollout.placement:
separate`; 1 rollout rank beside 1 training rank, or 2 training ranks at EP 2; tiny-qwen3-moe
in fp32): the pool's engine records every token's experts and the rows it hands over carry the
record to the trainer, whose forwards replay it.

- max_staleness 0 (the pool samples with the trainer's newest weights): the trainer's own
  router agrees with the record as in the colocated test (`moe/routing_mismatch` within near
  ties, every step) and the log-probs within fp32 rounding;
- max_staleness 1 with partial rollouts: at step 1 (both hold the initial weights) the same;
  later the record is the routing of samples a version behind, which the trainer replays
  (the mismatch then counts the routers' drift too).
"""

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
MOE = (
    "model.name=tiny-qwen3-moe",
    "model.dtype=float32",
    "actor.recompute_old_logp=always",
    "algorithm.routing_replay=rollout",
    "checkpoint.save_every=0",
)


EP2 = ("actor.parallel={tp: 1, pp: 1, dp: 2, ep: 2}", "launch.nproc_per_node=3")


@pytest.mark.parametrize(
    ("staleness", "layout"), [(0, ()), (1, ()), (0, EP2)], ids=["sync", "stale", "sync-ep2"]
)
def test_a_separate_pool_carries_the_engines_routing_record(tmp_path, staleness, layout):
    steps = 3
    proc = run_train(
        ASYNC,
        tmp_path / "run",
        *MOE,
        *layout,
        f"rollout.async.max_staleness={staleness}",
        f"trainer.total_steps={steps}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "run")
    assert sorted(metrics) == list(range(1, steps + 1))
    for step, m in metrics.items():
        # present only when the batch held the engine's record and the forward replayed it
        assert 0.0 <= m["moe/routing_mismatch"] <= 1.0, step
        assert 0.0 <= m["moe/routing_mismatch_update"] <= 1.0, step
        if staleness == 0 or step == 1:  # the engine sampled with the trainer's weights
            assert m["moe/routing_mismatch"] <= 0.01, (step, m["moe/routing_mismatch"])
            assert m["rollout/logp_diff_max"] < 1e-4, (step, m["rollout/logp_diff_max"])
    if staleness:
        assert any(m["async/staleness_max"] >= 1 for m in metrics.values())
