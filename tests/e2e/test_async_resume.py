"""Checkpoint and resume with rollouts in flight (`rollout.placement: separate`,
max_staleness 1): the training rank is killed (SIGKILL) just after taking step 5's samples,
while the rollout rank is already generating step 6's. The restarted run resumes from the
step-4 checkpoint; every step trains on the prompts the sampler dealt for it, in order, each
batch exactly once over the two runs: the in-flight samples are generated again from the
checkpoint's sampler position (nothing lost, nothing used twice), and the metrics hold each
step once."""

import json
import os
import signal
import subprocess

import pytest
from train_helpers import ROOT, metrics_by_step, run_train, train_command, train_env

from rl3d.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
HOOK = """
import json, os, signal

def record(step, batch, metrics):
    with open(os.environ["RL3D_TEST_PROMPTS"], "a") as f:
        f.write(json.dumps({"step": step, "index": sorted(set(batch["index"]))}) + "\\n")
    if step == int(os.environ.get("RL3D_TEST_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: step 6's rollout is in flight
"""


def expected_prompts(overrides, steps):
    from rl3d.controller.assemble import build_data

    data = build_data(load_config(str(ASYNC), list(overrides)).config)
    return [sorted({item.index for item in data.sampler.next_batch()}) for _ in range(steps)]


def test_resume_with_rollouts_in_flight(tmp_path, monkeypatch):
    (tmp_path / "prompt_hook.py").write_text(HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = tmp_path / "run"
    overrides = (
        "trainer.total_steps=6",
        "checkpoint.save_every=2",
        "trainer.hooks.on_rollout_end=prompt_hook:record",
    )
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    monkeypatch.setenv("RL3D_TEST_PROMPTS", str(first))
    monkeypatch.setenv("RL3D_TEST_KILL_AT", "5")
    env = train_env() | {"PYTHONPATH": os.pathsep.join([str(tmp_path), train_env()["PYTHONPATH"]])}
    # its own session: a killed rank's helper processes (multiprocessing) are cleaned up with it
    proc = subprocess.Popen(
        train_command(ASYNC, run, *overrides),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.wait(timeout=600) != 0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert (run / "checkpoints" / "step_00000004").is_dir()
    monkeypatch.setenv("RL3D_TEST_PROMPTS", str(second))
    monkeypatch.delenv("RL3D_TEST_KILL_AT")
    resumed = run_train(ASYNC, run, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    seen_first = [json.loads(line) for line in first.read_text().splitlines()]
    seen_second = [json.loads(line) for line in second.read_text().splitlines()]
    assert [r["step"] for r in seen_first] == [1, 2, 3, 4, 5]  # killed in step 5
    assert [r["step"] for r in seen_second] == [5, 6]  # resumed after step 4
    want = expected_prompts(overrides, 6)
    trained = [r["index"] for r in seen_first[:4] + seen_second]
    assert trained == want  # every batch once, in the sampler's order
    assert seen_first[4]["index"] == seen_second[0]["index"]  # the in-flight step's prompts, again
    assert sorted(metrics_by_step(run)) == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the killed run's rows after 4 dropped
    assert all(r["async/staleness_max"] <= 1 for r in rows)
