"""`rl3d slurm RECIPE --nodes 2` on a real SLURM cluster of two simulated nodes: slurmctld and
a slurmd on node0, a slurmd on node1, munge shared. The generated sbatch script's srun starts
one torchrun per node, the c10d rendezvous crosses nodes, and the GRPO quickstart as 2 nodes x
1 rank trains as 1 node x 2 ranks (and 2 nodes x 2 ranks as 1 node x 4). A node that loses
its link mid-run fails the job, and `rl3d slurm status` says why; with --requeue the job comes
back when the node does, and resumes from its last checkpoint."""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from multinode_helpers import FOUR_RANKS, QUICK, TIMEOUT_S, metrics_lines, wait_until
from train_helpers import GRPO, ROOT, assert_same_metrics, metrics_by_step, train_env

from rl3d.launch.slurm import read_job_id
from rl3d.testing.netns import SimNodes, netns_unavailable_reason
from rl3d.testing.netns_slurm import SLURMD_TIMEOUT_S, NetnsSlurmCluster
from rl3d.testing.slurm_cluster import TERMINAL_STATES, slurm_unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.distributed]


@pytest.fixture(scope="module")
def cluster():
    reason = netns_unavailable_reason() or slurm_unavailable_reason(install=True)
    if reason:
        pytest.skip(f"no multi-node SLURM cluster: {reason}")
    root = Path(tempfile.mkdtemp(prefix="rl3d-slurm2-"))  # not under basetemp (see tests/e2e/slurm)
    with SimNodes(2) as nodes:
        slurm = NetnsSlurmCluster(root / "cluster", nodes)
        slurm.start()
        try:
            yield slurm
        finally:
            slurm.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def run_root(cluster, request) -> Path:
    path = cluster.root.parent / "runs" / re.sub(r"\W", "_", request.node.name)
    path.mkdir(parents=True)
    yield path
    queued = cluster.client(["squeue", "-h", "-o", "%i"]).stdout.split()
    for job_id in queued:
        cluster.client(["scancel", job_id])


def rl3d_slurm(cluster, *args: str) -> subprocess.CompletedProcess:
    """`rl3d slurm ARGS` on node0 (the login node)."""
    env = {**train_env(), "SLURM_CONF": str(cluster.conf)}
    argv = [sys.executable, "-m", "rl3d.cli", "slurm", *args]
    return cluster.nodes[0].run(argv, env=env, cwd=ROOT, timeout=120)


def submit(cluster, run_dir: Path, *overrides: str) -> str:
    proc = rl3d_slurm(cluster, str(GRPO), "--nodes", "2", f"trainer.run_dir={run_dir}", *overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted job" in proc.stdout and "2 node(s) x 1 ranks" in proc.stdout, proc.stdout
    return read_job_id(run_dir)


def logs(cluster, run_dir: Path) -> str:
    parts = [f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "slurm/logs").glob("*.log"))]
    return "\n".join(parts) + "\n" + cluster.daemon_logs(15)


def test_quickstart_on_two_nodes_trains_like_one_node(cluster, run_root, single_node_metrics):
    run_dir = run_root / "run"
    job_id = submit(cluster, run_dir, *QUICK)
    state = cluster.wait_for_job(job_id, timeout_s=240)
    assert state == "COMPLETED", logs(cluster, run_dir)
    assert cluster.job_fields(job_id)["NodeList"] == "node[0-1]"
    for i in range(2):  # one torchrun per node, each on its own host
        node_log = (run_dir / f"slurm/logs/job{job_id}-r0-node{i}.log").read_text()
        assert f"rl3d node {i}/2 on node{i}:" in node_log and f"preflight on node{i}: ok" in node_log
    assert_same_metrics(single_node_metrics, metrics_by_step(run_dir), exact=True)
    status = rl3d_slurm(cluster, "status", str(run_dir))
    assert f"job      {job_id}  COMPLETED  exit 0:0" in status.stdout, status.stdout
    # --overwrite: the next job in this run dir starts over (its ranks would refuse a mix)
    again = rl3d_slurm(cluster, str(GRPO), "--nodes", "2", "--overwrite", f"trainer.run_dir={run_dir}")
    assert again.returncode == 0 and "overwrite: removed " in again.stdout, again.stdout + again.stderr
    assert "metrics.jsonl" in again.stdout and read_job_id(run_dir) != job_id
    cluster.client(["scancel", read_job_id(run_dir)])


def test_two_nodes_of_two_ranks_train_like_one_node_with_four(cluster, run_root, four_rank_metrics):
    run_dir = run_root / "run"
    four = (*QUICK, *FOUR_RANKS, "launch.nproc_per_node=4")  # a valid 4-rank recipe, split over 2 nodes
    proc = rl3d_slurm(cluster, str(GRPO), "--nodes", "2", f"trainer.run_dir={run_dir}", *four)
    assert proc.returncode == 0 and "2 node(s) x 2 ranks" in proc.stdout, proc.stdout + proc.stderr
    job_id = read_job_id(run_dir)
    state = cluster.wait_for_job(job_id, timeout_s=240)
    assert state == "COMPLETED", logs(cluster, run_dir)
    assert_same_metrics(four_rank_metrics, metrics_by_step(run_dir), exact=True)


def test_node_losing_its_link_fails_the_job_and_status_says_why(cluster, run_root):
    run_dir = run_root / "fault"
    overrides = ("--no-requeue", "trainer.total_steps=400", "checkpoint.save_every=0")
    job_id = submit(cluster, run_dir, *overrides, f"launch.timeout_s={TIMEOUT_S}")
    running = lambda: cluster.job_fields(job_id).get("JobState") not in TERMINAL_STATES
    wait_until(lambda: metrics_lines(run_dir) >= 1, running, lambda: logs(cluster, run_dir), timeout_s=240)
    cluster.nodes.set_link(1, up=False)  # node1's cable pulled mid-run
    try:
        # the ranks give up after TIMEOUT_S; SLURM declares node1 down after SLURMD_TIMEOUT_S
        state = cluster.wait_for_job(job_id, timeout_s=TIMEOUT_S + SLURMD_TIMEOUT_S + 90)
    finally:
        cluster.nodes.set_link(1, up=True)
    assert state in ("FAILED", "NODE_FAIL"), logs(cluster, run_dir)
    status = rl3d_slurm(cluster, "status", str(run_dir)).stdout
    assert f"job      {job_id}  {state}" in status, status
    # the node logs' tails: the rank that timed out, and the node and rank torchrun names
    assert "rank 0 failed: RuntimeError:" in status and f"{TIMEOUT_S * 1000}ms" in status, status
    assert "torchrun on node0: rank(s) [0] exited with an error" in status, status
    print(status)  # noqa: T201


def test_job_requeued_after_a_node_failure_resumes_when_the_node_returns(cluster, run_root):
    run_dir = run_root / "requeue"
    overrides = ("--requeue", "trainer.total_steps=8", "checkpoint.save_every=1")
    job_id = submit(cluster, run_dir, *overrides, f"launch.timeout_s={TIMEOUT_S}")
    running = lambda: cluster.job_fields(job_id).get("JobState") not in TERMINAL_STATES
    wait_until(lambda: metrics_lines(run_dir) >= 2, running, lambda: logs(cluster, run_dir), timeout_s=240)
    cluster.nodes.set_link(1, up=False)

    def requeued() -> bool:
        fields = cluster.job_fields(job_id)
        return fields.get("Restarts", "0") != "0" and fields.get("JobState") == "PENDING"

    try:
        wait_until(requeued, lambda: True, lambda: logs(cluster, run_dir), timeout_s=TIMEOUT_S + 150)
    finally:
        cluster.nodes.set_link(1, up=True)  # the node returns; slurmd re-registers (ReturnToService=2)
    before = metrics_by_step(run_dir)
    # a requeued job waits for its BeginTime (about two minutes): release it now
    cluster.client(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    state = cluster.wait_for_job(job_id, timeout_s=240)
    assert state == "COMPLETED", logs(cluster, run_dir)
    after = metrics_by_step(run_dir)
    assert sorted(after) == list(range(1, 9))
    assert after[1] == before[1]  # resumed from its checkpoint, not restarted: step 1 not run again
    assert (run_dir / f"slurm/logs/job{job_id}-r1-node1.log").exists()
