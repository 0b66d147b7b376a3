"""Fast tier: save -> SIGKILL -> resume equals an uninterrupted run; a damaged newest checkpoint
is moved aside and the run resumes from the one before, to the same metrics."""

import os
import subprocess

import pytest
from train_helpers import GRPO, metrics_by_step, run_train, train_command, train_env

pytestmark = [pytest.mark.e2e]
STEPS = ["trainer.total_steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=2"]
COMPARED = ("reward/score_mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean")
KILL_HOOK = """
import os


def kill_at_3(step, batch, metrics):
    if step == 3:  # after checkpoint 2, before checkpoint 4: as a crash or a preemption would
        os.killpg(os.getpgid(0), signal.SIGKILL)
"""


def same_metrics(a, b):
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for key in COMPARED:
            assert b[step][key] == a[step][key], (step, key)


def test_kill_then_resume_then_damage_then_resume(tmp_path):
    straight = tmp_path / "straight"
    assert run_train(GRPO, straight, *STEPS).returncode == 0
    expected = metrics_by_step(straight)

    run = tmp_path / "run"
    (tmp_path / "kill_hook.py").write_text(KILL_HOOK)
    env = train_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    killed = subprocess.run(  # its own session: the hook SIGKILLs the launcher and every rank
        train_command(GRPO, run, *STEPS, "trainer.hooks.on_step_end=kill_hook:kill_at_3"),
        env=env,
        start_new_session=True,
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode != 0, killed.stderr[-2000:]  # torchrun reports the killed ranks
    assert (run / "checkpoints/step_00000002").is_dir() and not (run / "checkpoints/step_00000004").exists()

    resumed = run_train(GRPO, run, *STEPS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "(step 2)" in resumed.stderr, resumed.stderr[-3000:]
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 4  # a killed run's rows after step 2 are dropped, not kept next to the new ones
    same_metrics(expected, metrics_by_step(run))

    # the newest checkpoint (step 4) damaged: its RNG file truncated
    rng = run / "checkpoints/step_00000004/rng_actor_rank1.pt"
    rng.write_bytes(rng.read_bytes()[:64])
    again = run_train(GRPO, run, *STEPS)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "damaged checkpoint step_00000004" in again.stderr and "rng_actor_rank1.pt" in again.stderr
    assert "(step 2)" in again.stderr
    assert (run / "checkpoints/step_00000004.damaged").is_dir()
    same_metrics(expected, metrics_by_step(run))


def test_restart_with_another_model_is_refused(tmp_path):
    run = tmp_path / "run"
    assert run_train(GRPO, run, "trainer.total_steps=2", "checkpoint.save_every=2").returncode == 0
    before = (run / "resolved_config.yaml").read_text()
    proc = run_train(GRPO, run, "trainer.total_steps=2", "model.name=tiny-llama-mha", "rollout.n=4")
    assert proc.returncode == 2
    assert "model.name" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (run / "resolved_config.yaml").read_text() == before
    never = run_train(GRPO, run, "trainer.total_steps=2", "checkpoint.resume=never")
    assert never.returncode == 2 and "checkpoint.resume" in never.stderr
    assert (run / "checkpoints/step_00000002").is_dir()
