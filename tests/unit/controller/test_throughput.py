"""The paper's throughput metric: tokens over the step's wall time, for the job and per device."""

import pytest

from rl3d.config import load_config
from rl3d.config.pools import role_pools
from rl3d.controller.trainer import throughput

RECIPES = "recipes"


def test_throughput_is_tokens_over_wall_time_and_per_device_over_every_rank():
    out = throughput(6000.0, 2.5, 4)
    assert out["perf/throughput_tokens_per_s"] == pytest.approx(2400.0, rel=1e-12)
    assert out["perf/throughput_tokens_per_s_per_device"] == pytest.approx(600.0, rel=1e-12)
    assert throughput(10.0, 0.0, 1)["perf/throughput_tokens_per_s"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "devices"),
    [
        ((), 2),  # actor tp=2: the colocated roles share its ranks
        (
            (
                "critic.colocate=false",
                "critic.parallel.tp=1",
                "critic.parallel.dp=2",
                "launch.nproc_per_node=4",
            ),
            4,
        ),
        (("rollout.placement=separate", "rollout.pool.dp=3", "launch.nproc_per_node=5"), 5),
    ],
)
def test_devices_count_every_pool(overrides, devices):
    cfg = load_config(f"{RECIPES}/quickstart_cpu_ppo.yaml", list(overrides)).config
    assert sum(pool.size for pool in role_pools(cfg)) == devices
