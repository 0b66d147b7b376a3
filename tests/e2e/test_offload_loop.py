"""The PPO quickstart (2 gloo ranks, colocated critic and reference) with every role's training
state offloaded around generation trains exactly as without offload: every metric of 3 steps
equal bit for bit, through a checkpoint at step 2 and validation at step 2, where the roles
come back for the save and leave again for the next generation."""

import pytest
from train_helpers import PPO, assert_same_metrics, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = [
    "trainer.total_steps=3",
    "checkpoint.save_every=2",
    "trainer.val_every=2",
    "logging.tensorboard=false",
]
OFFLOAD = [
    "actor.offload=[grads,optimizer]",  # params stay: the torch engine generates on them
    "critic.offload=[params,grads,optimizer]",
    "reference.offload=[params]",
]


def test_offload_around_generation_changes_nothing(tmp_path):
    plain = run_train(PPO, tmp_path / "plain", *STEPS)
    assert plain.returncode == 0, plain.stderr[-3000:]
    moved = run_train(PPO, tmp_path / "offload", *STEPS, *OFFLOAD)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "offloaded" in moved.stderr + moved.stdout
    assert_same_metrics(
        metrics_by_step(tmp_path / "plain"), metrics_by_step(tmp_path / "offload"), exact=True
    )
