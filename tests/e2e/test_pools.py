"""Critic and reference on their own resource pools (`colocate: false`), both backends.

With the critic in the actor's layout on its own 2 ranks, a PPO run is the colocated run bit for
bit: the pool loads the actor's initial weights from `run_dir/init_weights`, and its own world
computes exactly what the shared one did. In other layouts (critic 1-1-2, reference 1-1-1 on a
fifth rank) the run trains, checkpoints every pool and resumes exactly."""

import json

import pytest
from train_helpers import PPO, assert_same_metrics, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = ("trainer.total_steps=3", "checkpoint.save_every=0", "hybrid_engine.timeout_s=120")
OWN_CRITIC = ("critic.colocate=false", "launch.nproc_per_node=4")


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("colocated") / "run"
    proc = run_train(PPO, run_dir, *STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_by_step(run_dir)


@pytest.mark.parametrize("backend", ["spmd", "ray"])
def test_critic_on_its_own_pool_matches_the_colocated_run(colocated, backend, tmp_path):
    if backend == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    proc = run_train(PPO, run_dir, *STEPS, *OWN_CRITIC, f"launch.backend={backend}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "init_weights/rl3d_meta.json").exists()  # the actor pool wrote its start
    assert_same_metrics(colocated, metrics_by_step(run_dir), exact=True)


def test_pools_in_their_own_layouts_checkpoint_and_resume_exactly(tmp_path):
    layouts = (
        "critic.colocate=false",
        "critic.parallel.tp=1",
        "critic.parallel.dp=2",
        "reference.enabled=true",
        "reference.colocate=false",
        "algorithm.kl.coef=0.01",
        "launch.nproc_per_node=5",
        "checkpoint.save_every=2",
        "hybrid_engine.timeout_s=120",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_train(PPO, straight, "trainer.total_steps=4", *layouts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_train(PPO, resumed, "trainer.total_steps=2", *layouts).returncode == 0
    proc = run_train(PPO, resumed, "trainer.total_steps=4", *layouts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr

    a, b = metrics_by_step(straight), metrics_by_step(resumed)
    assert_same_metrics({s: a[s] for s in (3, 4)}, {s: b[s] for s in (3, 4)}, exact=True)
    assert all(a[s]["kl/actor_ref_k1"] != 0.0 for s in (2, 3, 4))  # the reference pool answers
    files = {p.name for p in (resumed / "checkpoints/step_00000004").iterdir()}
    assert {"actor", "critic", "rng_actor_rank1.pt", "rng_critic_rank1.pt", "rng_reference_rank0.pt"} <= files
    state = json.loads((resumed / "checkpoints/step_00000004/trainer_state.json").read_text())
    assert state["step"] == 4
