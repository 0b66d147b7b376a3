"""The Ray backend across two simulated nodes: a Ray head on node0, a worker on node1 (`ray
start`, a token of the test's own), the driver (`rl3d train ... launch.backend=ray
launch.ray_address=node0's`) on node0. The actor pool's two rank actors land one per node, and
the GRPO quickstart gives the spmd run's metrics step for step. node1's link pulled mid-run ends
the driver within launch.timeout_s (+ a few seconds) with an error naming node1 and its rank."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from multinode_helpers import QUICK, TIMEOUT_S, metrics_lines, wait_all, wait_until
from train_helpers import GRPO, assert_same_metrics, metrics_by_step, train_command, train_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.distributed]
pytest.importorskip("ray")

RAY_PORT = 6380
# the driver's, run on node0 after the training: on which node did each rank actor live?
WHERE = """
import sys, ray
from ray._private.state import actors  # the GCS's actor table (the state API needs a dashboard)
ray.init(address=sys.argv[1], logging_level="ERROR")
print(sorted(a["Address"]["IPAddress"] for a in actors().values() if a["ActorClassName"] == "RankHost"))
"""


def ray_cluster(nodes, tmp_path: Path) -> tuple[dict[str, str], str]:
    """A Ray node on every simulated node; (environment that joins it, the head's address)."""
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    env = {**train_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    ray = str(Path(sys.executable).with_name("ray"))
    head = f"{nodes[0].address}:{RAY_PORT}"
    common = ["--block", "--num-cpus=2", "--num-gpus=0", "--disable-usage-stats"]
    for node in nodes:
        # a temp dir per node: they share this machine's /tmp, not their Ray sessions
        where = [f"--node-ip-address={node.address}", f"--temp-dir=/tmp/{nodes.tag}ray{node.index}"]
        role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if node.index == 0 else []
        role = role or [f"--address={head}"]
        out = open(tmp_path / f"ray_node{node.index}.log", "w")
        node.popen([ray, "start", *role, *where, *common], env=env, stdout=out, stderr=subprocess.STDOUT)
        if node.index == 0:
            up = lambda: nodes[0].run([ray, "status", f"--address={head}"], env=env).returncode == 0  # noqa: B023
            wait_until(up, lambda: True, lambda: (tmp_path / "ray_node0.log").read_text())
    alive = [sys.executable, "-c", f"import ray; ray.init(address='{head}'); print(len(ray.nodes()))"]
    joined = lambda: nodes[0].run(alive, env=env).stdout.strip().endswith(str(len(nodes)))
    wait_until(joined, lambda: True, lambda: (tmp_path / "ray_node1.log").read_text(), timeout_s=120)
    return env, head


def test_ray_backend_spans_two_nodes_and_matches_spmd(sim_nodes, single_node_metrics, tmp_path):
    env, head = ray_cluster(sim_nodes, tmp_path)
    run_dir = tmp_path / "run"
    two_nodes = ("launch.backend=ray", f"launch.ray_address={head}", "launch.nnodes=2")
    two_nodes += ("launch.nproc_per_node=1",)
    driver = sim_nodes[0].run(train_command(GRPO, run_dir, *two_nodes, *QUICK), env=env, timeout=280)
    assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-4000:]
    assert f"at {head} (joined)" in driver.stderr
    assert_same_metrics(single_node_metrics, metrics_by_step(run_dir), exact=True)
    where = sim_nodes[0].run([sys.executable, "-c", WHERE, head], env=env)
    assert where.stdout.strip() == str(sorted(n.address for n in sim_nodes)), where.stdout + where.stderr


def test_link_down_mid_run_stops_the_ray_driver_within_the_timeout_naming_node_and_rank(sim_nodes, tmp_path):
    env, head = ray_cluster(sim_nodes, tmp_path)
    run_dir = tmp_path / "run"
    two_nodes = ("launch.backend=ray", f"launch.ray_address={head}", "launch.nnodes=2")
    two_nodes += ("launch.nproc_per_node=1", f"launch.timeout_s={TIMEOUT_S}", "trainer.total_steps=400")
    out = open(tmp_path / "driver.out", "w")
    cmd = train_command(GRPO, run_dir, *two_nodes, "checkpoint.save_every=0")
    driver = sim_nodes[0].popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    text = lambda: (tmp_path / "driver.out").read_text()[-5000:]
    wait_until(lambda: metrics_lines(run_dir) >= 1, lambda: driver.poll() is None, text, timeout_s=240)
    sim_nodes.set_link(1, up=False)  # node1's cable pulled mid-run
    [(code, seconds)] = wait_all([driver], timeout_s=TIMEOUT_S + 120)
    print(f"driver ended {seconds:.0f} s after the link went down, status {code}\n{text()}")  # noqa: T201
    assert code == 1, text()
    failed = [line for line in text().splitlines() if "run failed:" in line]
    # the driver's pings (rl3d.single_controller.ray_liveness: silent for launch.timeout_s, then the
    # driver closes), not Ray's node health check (65 s here before); measured 18-30 s under load
    assert seconds <= TIMEOUT_S + 25, text()
    lost = f"on node node1 ({sim_nodes[1].address}) did not answer"
    assert failed and "WorkerDiedError" in failed[-1] and lost in failed[-1], text()
    assert "rank(s) [" in failed[-1], text()
