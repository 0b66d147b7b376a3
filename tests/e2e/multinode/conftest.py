"""Simulated nodes for the multi-node tests of this folder (`rl3d.testing.netns`).

`sim_nodes` gives two nodes (node0, node1), `make_sim_nodes(k, rate_mbit=..., burst_kb=...)`
any number, shaped or not; both remove every namespace, link and process they made after the
test, failed or not. Without root or iproute2 the tests here are skipped with the reason.
"""

import pytest

from rl3d.testing.netns import SimNodes, netns_unavailable_reason


@pytest.fixture
def make_sim_nodes():
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"no simulated nodes: {reason}")
    made: list[SimNodes] = []

    def make(num_nodes: int = 2, **kwargs) -> SimNodes:
        nodes = SimNodes(num_nodes, **kwargs)
        made.append(nodes)
        nodes.start()
        return nodes

    try:
        yield make
    finally:
        for nodes in made:
            nodes.close()


@pytest.fixture
def sim_nodes(make_sim_nodes) -> SimNodes:
    return make_sim_nodes(2)


@pytest.fixture(scope="session")
def single_node_metrics(tmp_path_factory) -> dict[int, dict]:
    """The GRPO quickstart's metrics by step, as 1 node x 2 ranks with `rl3d train` (spmd)."""
    from multinode_helpers import QUICK
    from train_helpers import GRPO, metrics_by_step, run_train

    run_dir = tmp_path_factory.mktemp("single_node") / "run"
    proc = run_train(GRPO, run_dir, *QUICK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_by_step(run_dir)


@pytest.fixture(scope="session")
def four_rank_metrics(tmp_path_factory) -> dict[int, dict]:
    """The GRPO quickstart at tp 2 x dp 2, as 1 node x 4 ranks with `rl3d train` (spmd)."""
    from multinode_helpers import FOUR_RANKS, QUICK
    from train_helpers import GRPO, metrics_by_step, run_train

    run_dir = tmp_path_factory.mktemp("single_node_4") / "run"
    proc = run_train(GRPO, run_dir, *QUICK, *FOUR_RANKS, "launch.nproc_per_node=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_by_step(run_dir)
