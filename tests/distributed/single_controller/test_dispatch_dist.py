"""Dispatch modes on 4 real gloo ranks laid out as megatron p-t-d = 1-2-2."""

import pytest
import torch

from rl3d.parallel import ParallelLayout
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register
from rl3d.single_controller.spmd import SPMDWorkerGroup
from rl3d.testing.spawn import run_distributed


class SquareWorker:
    """A worker on a 1-2-2 grid: tp pairs share a DP chunk; only tp=0 reports it."""

    def __init__(self, rank):
        self.rank = rank
        self.coords = ParallelLayout(1, 2, 2).coords(rank)
        self.seen = []

    def dispatch_info(self):
        return DispatchInfo(dp_rank=self.coords.dp, dp_size=2, is_collector=self.coords.tp == 0)

    @register(Dispatch.MEGATRON_COMPUTE)
    def square(self, batch):
        self.seen.append(batch["x"].tolist())
        # tp=1 returns a wrong value on purpose: collection must ignore non-collectors
        scale = 1.0 if self.coords.tp == 0 else -100.0
        return DataBatch({"y": batch["x"] ** 2 * scale})

    @register(Dispatch.MEGATRON_COMPUTE)
    def metrics(self, batch):
        return {"mean_x": float(batch["x"].mean())}

    def describe(self):  # ONE_TO_ALL by default
        return "same everywhere"


def worker_main(rank, world):
    worker = SquareWorker(rank)
    group = SPMDWorkerGroup(worker, role="actor")
    batch = DataBatch({"x": torch.arange(8, dtype=torch.float32)})
    out = group.call("square", batch)
    metrics = group.call("metrics", batch)
    return {"y": out["y"].tolist(), "seen": worker.seen, "metrics": metrics, "desc": group.call("describe")}


@pytest.mark.distributed
def test_megatron_compute_splits_over_dp_and_collects_from_tp0():
    results = run_distributed(worker_main, 4, timeout_s=120)
    expected = [float(i * i) for i in range(8)]
    for rank, r in enumerate(results):
        assert r["y"] == expected  # every rank gets the full, correct result
        dp = ParallelLayout(1, 2, 2).coords(rank).dp
        assert r["seen"] == [[float(i) for i in range(dp * 4, dp * 4 + 4)]]
        assert r["metrics"] == {"mean_x": (1.5 + 5.5) / 2} and r["desc"] == "same everywhere"
