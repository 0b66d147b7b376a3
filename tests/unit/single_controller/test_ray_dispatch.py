"""`RayWorkerGroup` on toy pure-Python workers: 2 Ray actors in their own gloo world, each
dispatch mode's split and collection, the fan-out pool, and failures naming role and rank."""

import os
import sys

import pytest
import torch

from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.distributed  # two Ray actors in a gloo world


class ToyWorker:
    """`reverse`: DP rank = 1 - rank, so DP order differs from rank order."""

    def __init__(self, rank: int, *, tp: int, reverse: bool = False):
        self.rank, self.tp = rank, tp
        dp_size = 2 // tp
        dp_rank = (1 - rank if reverse else rank) // tp
        self.info = DispatchInfo(dp_rank=dp_rank, dp_size=dp_size, is_collector=rank % tp == 0)

    def dispatch_info(self) -> DispatchInfo:
        return self.info

    @register(Dispatch.DP_COMPUTE)
    def double(self, batch: DataBatch, *, scale: int = 2) -> DataBatch:
        return DataBatch({"x": batch["x"] * scale, "rank": torch.full((len(batch),), self.rank)})

    @register(Dispatch.MEGATRON_COMPUTE)
    def rows(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"x": batch["x"] + 100, "rank": torch.full((len(batch),), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def world_sum(self, k: int) -> tuple[int, float]:
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + k)])
        dist.all_reduce(t)
        return self.rank, float(t)

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"toy failure on rank {rank}")


class ToyScorer:
    def dispatch_info(self) -> DispatchInfo:
        return DispatchInfo(dp_rank=0, dp_size=1, is_collector=True)

    @register(Dispatch.ONE_TO_ALL, metrics="sum")
    def score(self, batch: DataBatch) -> tuple[DataBatch, dict]:
        return DataBatch({"score": batch["x"].float() / 10, "pid": torch.full((len(batch),), os.getpid())}), {
            "count": len(batch)
        }


def build_toys() -> dict:
    rank = int(os.environ["RANK"])
    return {
        "dp": ToyWorker(rank, tp=1),
        "dp_reversed": ToyWorker(rank, tp=1, reverse=True),
        "tp": ToyWorker(rank, tp=2),
    }


@pytest.fixture(scope="module")
def ranks():
    from ray import cloudpickle

    from rl3d.single_controller.ray import RankActors, ResourcePool

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import tests/
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="ERROR",
        namespace="rl3d-test-dispatch",
    )
    try:
        actors = RankActors(ResourcePool("toy", num_bundles=2, bundle={"CPU": 1}), timeout_s=60)
        actors.init_distributed("gloo", timeout_s=60)
        actors.setup(build_toys)
        yield actors
    finally:
        ray.shutdown()


def batch_of(n: int) -> DataBatch:
    return DataBatch({"x": torch.arange(n)}, {"tag": [f"s{i}" for i in range(n)]})


def test_dp_compute_splits_per_dp_rank_and_collects_in_dp_order(ranks):
    out = ranks.group("dp").call("double", batch_of(6), scale=3)
    assert out["x"].tolist() == [0, 3, 6, 9, 12, 15]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1]  # rank 0 had the first half
    rev = ranks.group("dp_reversed").call("double", batch_of(6))
    assert rev["x"].tolist() == [0, 2, 4, 6, 8, 10]  # DP order, not rank order
    assert rev["rank"].tolist() == [1, 1, 1, 0, 0, 0]


def test_megatron_compute_gives_the_whole_batch_to_tp_and_collects_tp0(ranks):
    out = ranks.group("tp").call("rows", batch_of(4))
    assert out["x"].tolist() == [100, 101, 102, 103]
    assert out["rank"].tolist() == [0, 0, 0, 0]  # only the collector's output


def test_one_to_all_runs_everywhere_in_one_world_and_returns_rank0(ranks):
    assert ranks.group("dp").call("world_sum", 5) == (0, 11.0)  # (0 + 5) + (1 + 5)


def test_unknown_method_and_failed_call_name_role_and_rank(ranks):
    from rl3d.single_controller.ray import WorkerCallError

    with pytest.raises(AttributeError, match="tp worker has no method 'nope'"):
        ranks.group("tp").call("nope")
    with pytest.raises(
        WorkerCallError, match=r"dp worker rank 1 failed in fail_on: ValueError: toy failure on rank 1\n"
    ):
        ranks.group("dp").call("fail_on", 1)


def test_fan_out_pool_keeps_order_and_adds_counts(ranks):
    from rl3d.single_controller.ray import FanOutGroup, ResourcePool

    pool = FanOutGroup(ResourcePool("scorers", num_bundles=2, bundle={"CPU": 1}), ToyScorer, role="reward")
    try:
        scores, metrics = pool.call("score", batch_of(5))
        assert scores["score"].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
        assert len(set(scores["pid"].tolist())) == 2  # both actors took a slice
        assert metrics == {"count": 5}
        scores, metrics = pool.call("score", batch_of(1))  # fewer rows than actors
        assert scores["score"].tolist() == [0.0] and metrics == {"count": 1}
    finally:
        pool.shutdown()


def test_dead_actor_is_reported_with_role_and_rank(ranks):
    from rl3d.single_controller.ray import WorkerDiedError

    group = ranks.group("dp", timeout_s=30)
    ray.kill(ray.get_actor("toy/rank1"), no_restart=True)
    # rank 0 blocks in the all_reduce with the dead rank 1: the death is still reported first
    with pytest.raises(WorkerDiedError, match=r"dp worker rank 1 died during world_sum") as info:
        group.call("world_sum", 1)
    assert (info.value.role, info.value.rank) == ("dp", 1)
