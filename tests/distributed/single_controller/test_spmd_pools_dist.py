"""Own resource pools under spmd: 4 gloo ranks split into an actor pool (1-2-1, ranks 0-1) and
a critic pool (1-1-2, ranks 2-3), each its own torch.distributed world."""

import time

import torch
import torch.distributed as dist

from rl3d.config.pools import Pool
from rl3d.parallel import ParallelLayout
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register
from rl3d.single_controller.spmd import SPMDWorkerGroup
from rl3d.single_controller.spmd_pools import split_world
from rl3d.testing.spawn import run_distributed

POOLS = [
    Pool("actor", ParallelLayout(1, 2, 1), 0, ("actor",)),
    Pool("critic", ParallelLayout(1, 1, 2), 2, ("critic",)),
]


class DoubleWorker:
    """A critic-pool worker: each DP rank doubles its half of the batch."""

    def __init__(self):
        self.dp_rank = dist.get_rank()  # rank in the pool's own world

    def dispatch_info(self):
        return DispatchInfo(dp_rank=self.dp_rank, dp_size=2, is_collector=True)

    @register(Dispatch.MEGATRON_COMPUTE)
    def double(self, batch):
        return DataBatch(
            {"y": batch["x"] * 2, "pool_world": torch.full((len(batch),), dist.get_world_size())}
        )

    @register(Dispatch.ONE_TO_ALL)
    def fail(self):
        if self.dp_rank == 1:
            raise ValueError("value head exploded")
        return "ok"


def split_and_dispatch(rank, world):
    pool, channel = split_world(POOLS, backend="gloo", timeout_s=30)
    # the pool is now this rank's whole torch.distributed world
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    critic = SPMDWorkerGroup(
        DoubleWorker() if pool.name == "critic" else None, role="critic", channel=channel
    )
    out = critic.call("double", DataBatch({"x": torch.arange(4.0)}))
    try:
        critic.call("fail")
        failure = None
    except Exception as err:
        failure = str(err)
    return pool.name, dist.get_rank(), total.item(), out["y"].tolist(), out["pool_world"].tolist(), failure


def test_pools_become_worlds_and_the_controller_spans_them():
    results = run_distributed(split_and_dispatch, 4, timeout_s=120)
    assert [r[:3] for r in results] == [
        ("actor", 0, 2.0),
        ("actor", 1, 2.0),
        ("critic", 0, 2.0),
        ("critic", 1, 2.0),
    ]
    for _, _, _, y, pool_world, failure in results:
        assert y == [0.0, 2.0, 4.0, 6.0]  # every rank, in either pool, gets the critic's result
        assert pool_world == [2, 2, 2, 2]
        # the failing rank raises its own error; every other rank is told which world rank failed
        assert "value head exploded" in failure
    assert all("critic.fail failed on world rank 3" in r[5] for r in results[:3])


def silent_rank(rank, world):
    pool, channel = split_world(POOLS, backend="gloo", timeout_s=30, channel_timeout_s=3)
    if rank == 2:
        return None, 0.0  # dead or stuck: never answers the controller again
    started = time.monotonic()
    try:
        channel.barrier()
    except RuntimeError as err:
        return str(err), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_rank_that_never_answers_ends_the_others_within_the_timeout():
    results = run_distributed(silent_rank, 4, timeout_s=60)
    for rank in (0, 1, 3):
        message, seconds = results[rank]
        assert "controller channel: rank 2 did not answer within 3 s" in message
        assert seconds < 10
