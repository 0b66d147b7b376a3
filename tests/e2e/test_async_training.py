"""A separate rollout pool (`rollout.placement: separate`), end to end on 2 gloo ranks.

- max_staleness 0 on a separate rollout rank reproduces the colocated run bit for bit (same
  weights arrive over the weight sync, the same seeds sample the same tokens);
- max_staleness 1: every token's recorded policy version is within the bound at every step
  (the trainer also refuses a batch over it), tokens of both versions occur (partial rollouts),
  and the async/* and reshard/* metrics are logged.
"""

import json

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
SHORT = ("trainer.total_steps=4", "checkpoint.save_every=0")
ASYNC_KEYS = ("async/", "time/", "perf/", "reshard/")

HOOK = """
import json, os

def record(step, batch, metrics):
    path = os.environ["RL3D_TEST_VERSIONS"]
    with open(path, "a") as f:
        v = batch["policy_version"][batch["response_mask"].bool()]
        f.write(json.dumps({"step": step, "min": int(v.min()), "max": int(v.max()),
                            "index": sorted(set(batch["index"]))}) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("launch.nproc_per_node=1",),  # 1 training rank; 1 rollout rank
        ("actor.parallel.tp=2", "rollout.t_g=2", "rollout.pool.tp=2", "launch.nproc_per_node=2"),  # TP 2 both
    ],
    ids=["tp1", "tp2"],
)
def test_separate_pool_at_staleness_0_equals_colocated(tmp_path, layout):
    common = (*SHORT, "algorithm.rollout_correction.mode=none", *layout[:-1])
    colocated = ("rollout.placement=colocated", "rollout.async.max_staleness=0", layout[-1])
    sync = run_train(ASYNC, tmp_path / "colocated", *common, *colocated)
    assert sync.returncode == 0, sync.stderr[-3000:]
    ranks = int(layout[-1].split("=")[1])
    sep = run_train(
        ASYNC,
        tmp_path / "separate",
        *common,
        "rollout.async.max_staleness=0",
        f"launch.nproc_per_node={2 * ranks}",
    )
    assert sep.returncode == 0, sep.stderr[-3000:]
    a, b = metrics_by_step(tmp_path / "colocated"), metrics_by_step(tmp_path / "separate")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for key, value in a[step].items():
            if not key.startswith(ASYNC_KEYS) and key != "time":
                assert b[step][key] == value, (step, key, value, b[step][key])
        assert b[step]["async/staleness_max"] == 0.0
        assert b[step]["reshard/bytes"] > 0 if step < 4 else b[step]["reshard/bytes"] == 0.0


def test_staleness_never_exceeds_the_bound(tmp_path, monkeypatch):
    (tmp_path / "version_hook.py").write_text(HOOK)
    versions = tmp_path / "versions.jsonl"
    monkeypatch.setenv("RL3D_TEST_VERSIONS", str(versions))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    proc = run_train(
        ASYNC,
        tmp_path / "run",
        "trainer.total_steps=8",
        "checkpoint.save_every=0",
        "trainer.hooks.on_rollout_end=version_hook:record",
        "rollout.max_new_tokens=12",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_staleness_within_one(metrics_by_step(tmp_path / "run"), versions)


def check_staleness_within_one(metrics: dict, versions) -> list[dict]:
    """An 8-step run at max_staleness 1 whose hook wrote each step's token versions to
    `versions`: no token over the bound on either side, the pool ran ahead, the async/* and
    reshard/* metrics logged with the plan's bytes. Returns the hook's rows."""
    rows = [json.loads(line) for line in versions.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:  # the trainer at step k holds version k - 1; max_staleness = 1
        assert (r["step"] - 1) - r["min"] <= 1 and r["max"] <= r["step"] - 1, r
        m = metrics[r["step"]]
        assert m["async/staleness_max"] == (r["step"] - 1) - r["min"] <= 1
        assert 0.0 <= m["async/staleness_mean"] <= m["async/staleness_max"]
        for key in ("async/wait_trainer_s", "async/wait_rollout_s", "reshard/seconds"):
            assert m[key] >= 0.0
    assert any(m["async/staleness_max"] == 1.0 for m in metrics.values())  # it did run ahead
    assert all(metrics[s]["reshard/bytes"] == 500992.0 for s in range(1, 8))  # the plan's
    return rows


@pytest.mark.slow
def test_delta_weight_updates_train_exactly_as_full_ones(tmp_path):
    """20 steps at max_staleness 0 on the separate rollout rank, with weight syncs sent whole
    and as deltas (`rollout.weight_update`): the rollout engine samples from the trainer's exact
    bits either way, so every step's metrics but timing and bytes agree exactly; the delta run
    counts what it sent."""
    common = (
        "trainer.total_steps=20",
        "checkpoint.save_every=0",
        "algorithm.rollout_correction.mode=none",
        "rollout.async.max_staleness=0",
    )
    full = run_train(ASYNC, tmp_path / "full", *common)
    assert full.returncode == 0, full.stderr[-3000:]
    delta = run_train(ASYNC, tmp_path / "delta", *common, "rollout.weight_update=delta")
    assert delta.returncode == 0, delta.stderr[-3000:]
    a, b = metrics_by_step(tmp_path / "full"), metrics_by_step(tmp_path / "delta")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        for key, value in a[step].items():
            if not key.startswith(ASYNC_KEYS) and key != "time":
                assert b[step][key] == value, (step, key, value, b[step][key])
    for step in range(1, 20):  # the last step's policy is used by nothing: not sent
        m = b[step]
        assert 0 < m["reshard/delta_bytes"] == m["reshard/bytes"], m
        assert m["reshard/full_bytes"] == a[step]["reshard/bytes"]  # the plan's: one rollout rank
        assert 0 < m["reshard/changed_fraction"] <= 1
        assert m["reshard/delta_bytes"] <= m["reshard/full_bytes"] + 40 * 1024  # headers at most
