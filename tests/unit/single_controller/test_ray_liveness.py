"""The Ray driver's deadline on a lost node (`RankActors(node_timeout_s=...)`): a rank busy in a
long call still answers the driver's pings (its own concurrency group), and a rank whose process
stops answering (as on a node whose link is gone; here it SIGSTOPs itself) ends the wait within
the deadline with `WorkerDiedError` naming its node (hostname and IP) and rank."""

import os
import signal
import socket
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.distributed  # two Ray actors

DEADLINE_S = 3.0


def busy_then_stop(state, stop: bool):
    """Rank 0 works for twice the deadline; with `stop`, rank 1 freezes its own process."""
    rank = int(ray.get_runtime_context().get_actor_name().rsplit("rank", 1)[1])
    if rank == 0:
        time.sleep(2 * DEADLINE_S)
    elif stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    return rank


def test_a_silent_rank_is_named_with_its_node_within_the_deadline():
    from ray import cloudpickle

    from rl3d.single_controller.ray import RankActors, ResourcePool, WorkerDiedError

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        pool = ResourcePool("toy", num_bundles=2, bundle={"CPU": 1})
        actors = RankActors(pool, timeout_s=120, node_timeout_s=DEADLINE_S)
        host = socket.gethostname()
        assert [n.split(" ")[0] for n in actors.liveness.nodes] == [host, host]
        assert actors.run(busy_then_stop, False) == [0, 1]  # busy for 2x the deadline: not lost
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            actors.run(busy_then_stop, True, what="a step")
        waited = time.monotonic() - start
        assert DEADLINE_S <= waited <= DEADLINE_S + 4, waited
        assert info.value.rank == 1
        message = str(info.value)
        assert f"rank(s) [1] on node {host} (" in message and "during a step" in message, message
    finally:
        ray.shutdown()
