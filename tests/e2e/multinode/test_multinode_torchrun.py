"""torchrun across two simulated nodes, without SLURM: one `torchrun --nnodes 2` per node, the
c10d rendezvous served by node0 and found by name; the GRPO quickstart as 2 nodes x 1 rank
trains exactly as 1 node x 2 ranks. Then a fault: node1's cable is pulled mid-run, and both
nodes end within `launch.timeout_s`, naming the ranks and the node."""

import subprocess
import sys
from pathlib import Path

import pytest
from multinode_helpers import FOUR_RANKS, QUICK, TIMEOUT_S, metrics_lines, wait_all, wait_until
from train_helpers import GRPO, assert_same_metrics, metrics_by_step, train_env

from rl3d.launch.torchrun import STUCK_AFTER_S

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.distributed]

RDZV_PORT = 29400


def start_torchrun(nodes, run_dir: Path, *overrides: str, per_node: int = 1) -> list[subprocess.Popen]:
    """One torchrun per node (`per_node` ranks each), rendezvous at node0; output in
    run_dir/node<i>.out."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for node in nodes:
        cmd = [
            sys.executable, "-m", "rl3d.launch.torchrun", f"--nnodes={len(nodes)}",
            f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes[0].hostname}:{RDZV_PORT}", "--rdzv-id=mn",
            "--max-restarts=0", "-m", "rl3d.train", str(GRPO), f"trainer.run_dir={run_dir}",
            f"launch.nnodes={len(nodes)}", f"launch.nproc_per_node={per_node}", *overrides,
        ]  # fmt: skip
        out = open(run_dir / f"node{node.index}.out", "w")
        procs.append(node.popen(cmd, env=train_env(), stdout=out, stderr=subprocess.STDOUT))
    return procs


def outputs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("node*.out")))


def test_two_nodes_train_like_one_node_with_two_ranks(sim_nodes, single_node_metrics, tmp_path):
    run_dir = tmp_path / "run"
    procs = start_torchrun(sim_nodes, run_dir, *QUICK)
    codes = [proc.wait(timeout=240) for proc in procs]
    assert codes == [0, 0], outputs(run_dir)
    assert_same_metrics(single_node_metrics, metrics_by_step(run_dir), exact=True)


def test_two_nodes_of_two_ranks_train_like_one_node_with_four(sim_nodes, four_rank_metrics, tmp_path):
    """2 nodes x 2 ranks (each node one TP pair, DP across the nodes) == 1 node x 4 ranks."""
    run_dir = tmp_path / "run"
    procs = start_torchrun(sim_nodes, run_dir, *QUICK, *FOUR_RANKS, per_node=2)
    codes = [proc.wait(timeout=240) for proc in procs]
    assert codes == [0, 0], outputs(run_dir)
    assert_same_metrics(four_rank_metrics, metrics_by_step(run_dir), exact=True)


def test_link_down_mid_run_ends_both_nodes_within_the_timeout(sim_nodes, tmp_path):
    run_dir = tmp_path / "run"
    overrides = ("trainer.total_steps=200", "checkpoint.save_every=0", f"launch.timeout_s={TIMEOUT_S}")
    procs = start_torchrun(sim_nodes, run_dir, *overrides)
    alive = lambda: all(p.poll() is None for p in procs)
    wait_until(lambda: metrics_lines(run_dir) >= 1, alive, lambda: outputs(run_dir))
    sim_nodes.set_link(1, up=False)  # node1's cable pulled mid-run
    # the ranks time out after TIMEOUT_S; node1's torchrun, blocked on node0's store, is ended
    # by its watchdog (rl3d.launch.torchrun) STUCK_AFTER_S later
    ends = wait_all(procs, timeout_s=TIMEOUT_S + STUCK_AFTER_S + 30)
    text = outputs(run_dir)
    assert all(code not in (None, 0) for code, _ in ends), (ends, text)
    for node in sim_nodes:  # each node names itself and its rank, and says why
        out = (run_dir / f"node{node.index}.out").read_text()
        assert f"torchrun on {node.hostname}: rank(s) [{node.index}] exited with an error" in out, text
        assert f"rank {node.index} failed: RuntimeError:" in out and f"{TIMEOUT_S * 1000}ms" in out, text
    print("ends (exit status, seconds after the link went down):", ends)  # noqa: T201
