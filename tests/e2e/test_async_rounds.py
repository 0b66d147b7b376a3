"""Extra rollout rounds and validation on a separate rollout pool (`rollout.placement: separate`),
end to end on 2 gloo ranks (one training rank, one rollout rank).

A step's first round is the pool's, generated ahead; DAPO's refill rounds, ReMax's greedy
baseline and validation are generation requests to the pool, answered with the newest policy
the trainer sent (validation after step k: version k, as the colocated run validates).

- max_staleness 1: DAPO (with ReMax's baseline) and validation run; every training token's
  recorded version is within the bound, refill rounds happen, validation reports the version
  it used;
- max_staleness 0 (slow): validation gives the colocated run's val/* bit for bit and leaves the
  training metrics as without it; DAPO and ReMax equal the colocated run bit for bit.
"""

import csv
import json

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

ASYNC = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
COLOCATED = ("rollout.placement=colocated", "launch.nproc_per_node=1")  # the same 1-1-1 actor
WALL_CLOCK = ("time", "perf/", "async/", "reshard/")
VALIDATE = ("trainer.val_every=2", "trainer.val_before_train=true", "trainer.val_pass_k=[1,4]")
# one response token: a group of 4 often scores all 0 or all 1, so DAPO refills
DAPO = ("algorithm.dynamic_sampling=true", "rollout.max_new_tokens=1")
REMAX = ("algorithm.adv_estimator=remax",)

HOOK = """
import json, os

def record(step, batch, metrics):
    with open(os.environ["RL3D_TEST_VERSIONS"], "a") as f:
        v = batch["policy_version"][batch["response_mask"].bool()]
        f.write(json.dumps({"step": step, "min": int(v.min()), "max": int(v.max())}) + "\\n")
"""


def same(a: dict, b: dict, *, prefix: str = "") -> None:
    """Every metric of `a` that starts with `prefix` and is no wall-clock one is in `b`, equal."""
    assert sorted(a) == sorted(b)
    for step, row in a.items():
        for key, value in row.items():
            if key.startswith(prefix) and not key.startswith(WALL_CLOCK):
                assert b[step].get(key) == value, (step, key, value, b[step].get(key))


def test_dapo_remax_and_validation_at_staleness_1(tmp_path, monkeypatch):
    (tmp_path / "version_hook.py").write_text(HOOK)
    versions = tmp_path / "versions.jsonl"
    monkeypatch.setenv("RL3D_TEST_VERSIONS", str(versions))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run_dir = tmp_path / "run"
    proc = run_train(
        ASYNC,
        run_dir,
        "trainer.total_steps=4",
        "checkpoint.save_every=0",
        "trainer.hooks.on_rollout_end=version_hook:record",
        *DAPO,
        *REMAX,
        *VALIDATE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(run_dir)
    rows = [json.loads(line) for line in versions.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    for r in rows:  # the trainer at step k holds version k - 1; max_staleness = 1
        assert (r["step"] - 1) - r["min"] <= 1 and r["max"] <= r["step"] - 1, r
        m = metrics[r["step"]]
        assert m["async/staleness_max"] == (r["step"] - 1) - r["min"] <= 1
        # a request per extra round and one greedy baseline per round (ReMax)
        assert m["async/requests"] == 2 * m["generate/rounds"] - 1
    assert any(metrics[r["step"]]["generate/rounds"] > 1 for r in rows)  # DAPO refilled
    with open(run_dir / "validation.csv", newline="") as f:
        val = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    assert [r["step"] for r in val] == [0, 2, 4]
    assert all(r["val/policy_version"] == r["step"] for r in val)  # after step k: version k
    assert all(0 <= r["val/pass_at_1"] <= r["val/pass_at_4"] <= 1 for r in val)


@pytest.mark.slow
def test_validation_on_the_pool_equals_colocated_at_staleness_0(tmp_path):
    common = ("trainer.total_steps=3", "checkpoint.save_every=0", "rollout.async.max_staleness=0")
    common += ("algorithm.rollout_correction.mode=none",)
    runs = {
        "colocated": (*common, *VALIDATE, *COLOCATED),
        "separate": (*common, *VALIDATE),
        "unvalidated": common,
    }
    for name, overrides in runs.items():
        proc = run_train(ASYNC, tmp_path / name, *overrides)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    col, sep, plain = (metrics_by_step(tmp_path / name) for name in runs)
    same(col, sep)  # val/* bit for bit, and the training metrics
    assert [s for s in sep if "val/score_greedy" in sep[s]] == [0, 2, 3]
    assert all(sep[s]["val/policy_version"] == s for s in (0, 2, 3))
    same(plain, {s: sep[s] for s in plain})  # validation changes no training metric


@pytest.mark.slow
@pytest.mark.parametrize("algo", [DAPO, REMAX], ids=["dapo", "remax"])
def test_extra_rounds_on_the_pool_equal_colocated_at_staleness_0(tmp_path, algo):
    common = ("trainer.total_steps=4", "checkpoint.save_every=0", "rollout.async.max_staleness=0")
    common += ("algorithm.rollout_correction.mode=none", *algo)
    for name, extra in (("colocated", COLOCATED), ("separate", ())):
        proc = run_train(ASYNC, tmp_path / name, *common, *extra)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    col, sep = metrics_by_step(tmp_path / "colocated"), metrics_by_step(tmp_path / "separate")
    same(col, sep)
    assert all(sep[s]["async/staleness_max"] == 0.0 for s in sep)
    rounds = [sep[s]["generate/rounds"] for s in sorted(sep)]
    greedy_rounds = rounds if algo == REMAX else [0] * len(rounds)  # ReMax: one per round
    assert [sep[s]["async/requests"] for s in sorted(sep)] == [
        r - 1 + g for r, g in zip(rounds, greedy_rounds, strict=True)
    ]
    assert algo != DAPO or max(rounds) > 1  # DAPO refilled: those rounds were requests


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("actor.parallel.tp=2", "rollout.t_g=2", "rollout.pool.tp=2"),  # one engine over 2 ranks
        ("actor.parallel.dp=2", "rollout.pool.dp=2"),  # 2 training ranks, 2 engines
    ],
    ids=["tp2", "dp2"],
)
def test_rounds_and_validation_on_a_two_rank_pool_equal_colocated(tmp_path, layout):
    """The TP ranks of an engine agree on which request to serve; two engines each answer
    their share; two training ranks read every answer."""
    common = ("trainer.total_steps=4", "checkpoint.save_every=0", "rollout.async.max_staleness=0")
    common += ("algorithm.rollout_correction.mode=none", *DAPO, *REMAX, *VALIDATE, *layout)
    runs = {
        "colocated": ("rollout.placement=colocated", "launch.nproc_per_node=2"),
        "separate": ("launch.nproc_per_node=4",),
    }
    for name, extra in runs.items():
        proc = run_train(ASYNC, tmp_path / name, *common, *extra)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    col, sep = metrics_by_step(tmp_path / "colocated"), metrics_by_step(tmp_path / "separate")
    same(col, sep)
    assert any(sep[s]["generate/rounds"] > 1 for s in range(1, 5))
    assert all(sep[s]["val/policy_version"] == s for s in (0, 2, 4))


@pytest.mark.slow
def test_rounds_and_validation_under_ray_equal_spmd(tmp_path):
    """The Ray driver runs the same AsyncTrainer and its rollout rank actors the same loop:
    DAPO + ReMax + validation at max_staleness 0 give the spmd run's metrics bit for bit."""
    pytest.importorskip("ray")
    from test_ray_async import RAY, env_with, train

    common = ("trainer.total_steps=4", "checkpoint.save_every=0", "rollout.async.max_staleness=0")
    common += ("algorithm.rollout_correction.mode=none", *DAPO, *REMAX, *VALIDATE)
    env = env_with(tmp_path)
    for name, extra in (("spmd", ()), ("ray", (RAY,))):
        proc, _ = train(tmp_path / name, *common, *extra, env=env)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    spmd, ray = metrics_by_step(tmp_path / "spmd"), metrics_by_step(tmp_path / "ray")
    same(spmd, ray)
    assert all(ray[s]["val/policy_version"] == s for s in (0, 2, 4))
    assert any(ray[s]["async/requests"] > 1 for s in range(1, 5))  # refill and baseline requests
