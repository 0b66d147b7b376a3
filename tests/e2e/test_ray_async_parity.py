"""A separate rollout pool at max_staleness 0 under the Ray backend gives the spmd backend's
separate run metric for metric, bit for bit (and the spmd one equals the colocated run:
tests/e2e/test_async_training.py), with one rollout rank and with a t_g = 2 pool, and with
delta weight updates (the bytes each sync sent too)."""

import pytest
from test_ray_async import RAY, env_with, train
from train_helpers import metrics_by_step

pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# wall-clock metrics: differ run to run
TIMING = ("time/", "perf/", "async/wait_", "async/rollout_generate_", "reshard/seconds")


def assert_equal_but_timing(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        keys = {k for k in a[step] if not k.startswith(TIMING) and k != "time"}
        assert keys == {k for k in b[step] if not k.startswith(TIMING) and k != "time"}
        for key in sorted(keys):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


@pytest.mark.parametrize(
    "layout",
    [
        ("launch.nproc_per_node=2",),  # actor 1-1-1, one rollout rank
        pytest.param(
            ("actor.parallel.tp=2", "rollout.t_g=2", "rollout.pool.tp=2", "launch.nproc_per_node=4"),
            marks=pytest.mark.slow,
        ),
        pytest.param(  # delta weight updates: the rank actors keep the sender's state
            ("launch.nproc_per_node=2", "rollout.weight_update=delta"), marks=pytest.mark.slow
        ),
    ],
    ids=["tp1", "tp2", "tp1-delta"],
)
def test_ray_separate_pool_equals_the_spmd_one(tmp_path, layout):
    common = (
        "trainer.total_steps=4",
        "checkpoint.save_every=0",
        "rollout.async.max_staleness=0",
        "algorithm.rollout_correction.mode=none",
        *layout,
    )
    env = env_with(tmp_path)
    spmd, spmd_s = train(tmp_path / "spmd", *common, env=env)
    assert spmd.returncode == 0, spmd.stderr[-3000:]
    ray, ray_s = train(tmp_path / "ray", *common, RAY, env=env)
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert "rollout pool: " in ray.stderr and (tmp_path / "ray/logs/rank1.log").exists()
    a, b = metrics_by_step(tmp_path / "spmd"), metrics_by_step(tmp_path / "ray")
    assert sorted(b) == [1, 2, 3, 4]
    assert_equal_but_timing(a, b)
    assert all(m["async/staleness_max"] == 0.0 for m in b.values())
    print(f"4 steps: spmd {spmd_s:.1f} s, ray {ray_s:.1f} s (process start to exit)")  # noqa: T201
