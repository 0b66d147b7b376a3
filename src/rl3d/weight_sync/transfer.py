"""Run a rollout pool's weight-sync plan: training ranks send buckets, rollout ranks receive
and convert.

The actor's pool and the rollout pool are separate torch.distributed worlds (their megatron
grids differ), so the transfer runs on its own process group, `WeightBridge`, made at pool
set-up from the TCPStore the pools already share (`rl3d.single_controller.spmd_pools`). It spans
the actor pool's ranks (bridge ranks 0 .. n-1, in pool order) and the rollout pool's (n ..), the
plan's own rank numbering (`rl3d.hybrid_engine.pool`). It is a real tensor transfer (gloo on
CPU, NCCL on GPU), point to point per bucket: a weight sync of a 7B model does not fit through a
key-value store, and a broadcast would send every rollout rank the shards of the other
generation-TP ranks too. The plan runs through the hybrid engine's point-to-point executor
(`rl3d.hybrid_engine.p2p`) and its counted communicator, and reports `TransitionStats` as an
in-place transition does.

Both kinds of group wait `rollout.async.timeout_s` for the other side (NCCL's own default is
10 minutes). `reshard/seconds` stops once the transfer is complete: on NCCL `wait()` only
orders the device stream, so the clock stops after the device is synchronized too.

With `rollout.weight_update: delta` each end keeps its side of the routes' last buckets
(`DeltaSender`, `DeltaReceiver`, `rl3d.weight_sync.delta`) and the buckets travel as deltas
against them; the stats then carry the codec's counts (`TransitionStats.delta`), checked against
the bytes the communicator counted.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from rl3d.hybrid_engine.comm import CountedComm, DeltaCounts
from rl3d.hybrid_engine.p2p import generation_shards, run_phases
from rl3d.hybrid_engine.pool import POOL, PoolTransition
from rl3d.hybrid_engine.stats import TransitionStats
from rl3d.utils.device import current_gpu, synchronize
from rl3d.weight_sync.delta import DeltaReceiver, DeltaSender


class WeightBridge:
    """A process group over both pools' ranks, built directly on the shared store (the pools'
    default groups are their own worlds, so `dist.new_group` cannot span them)."""

    def __init__(self, store: Any, *, rank: int, num_train: int, num_rollout: int, device, timeout_s: float):
        self.rank, self.num_train, self.num_rollout = rank, num_train, num_rollout
        self.store = store  # kept as long as the bridge: a client store closed early breaks its group
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        size = num_train + num_rollout
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("weight_sync/", store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
            # A phase's batch (`rl3d.hybrid_engine.comm.batch_p2p`) runs on the whole group's
            # communicator, whose creation every rank must join: made now, while all are here,
            # not by a first batch that a rank with nothing to move never starts.
            self.pg.eager_connect_single_device(torch.device("cuda", current_gpu()))
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def train_rank(self, pool_rank: int) -> int:
        return pool_rank

    def rollout_rank(self, pool_rank: int) -> int:
        return self.num_train + pool_rank


def send_weights(
    bridge: WeightBridge,
    plan: PoolTransition,
    shards: dict[str, torch.Tensor],
    pool_rank: int,
    *,
    delta: DeltaSender | None = None,
) -> TransitionStats:
    """On a training rank: send every bucket the plan lists from this rank (blocking until all
    are taken). `shards`: the rank's training shards by global name (`transition_shards()`);
    `delta`: send each bucket as a delta against what its receiver holds."""
    dtype = next(iter(shards.values())).dtype if shards else torch.float32
    comm, start = _comm(bridge, bridge.train_rank(pool_rank)), time.perf_counter()
    if delta is not None:
        delta.begin()
    run_phases(
        plan.plan.phases,
        comm=comm,
        params=plan.params,
        train=plan.train,
        own=shards,
        dtype=dtype,
        device=bridge.device,
        exchange=None if delta is None else delta.exchange,
    )
    synchronize(bridge.device)  # NCCL's wait() only orders the stream: the clock stops when done
    return _stats(comm, time.perf_counter() - start, None if delta is None else delta.counts())


def receive_weights(
    bridge: WeightBridge,
    plan: PoolTransition,
    pool_rank: int,
    *,
    dtype: torch.dtype,
    delta: DeltaReceiver | None = None,
) -> tuple[dict[str, torch.Tensor], TransitionStats]:
    """On a rollout rank: receive this rank's buckets into fresh buffers and build its
    generation-TP shard of every parameter (name -> tensor, what the torch engine loads).
    `delta`: the buckets come as deltas against the ones it holds."""
    comm, start = _comm(bridge, bridge.rollout_rank(pool_rank)), time.perf_counter()
    if delta is not None:
        delta.begin()
    got, _ = run_phases(
        plan.plan.phases,
        comm=comm,
        params=plan.params,
        train=plan.train,
        own={},
        dtype=dtype,
        device=bridge.device,
        exchange=None if delta is None else delta.exchange,
    )
    synchronize(bridge.device)
    stats = _stats(comm, time.perf_counter() - start, None if delta is None else delta.counts())
    weights = generation_shards(
        got, plan.params, train_tp=plan.train.t, gen_tp=plan.gen_tp, gen_tp_rank=pool_rank % plan.gen_tp
    )
    return weights, stats


def _comm(bridge: WeightBridge, rank: int) -> CountedComm:
    return CountedComm(rank, bridge.timeout_s, bridge=bridge.pg)


def _stats(comm: CountedComm, seconds: float, delta: DeltaCounts | None) -> TransitionStats:
    c = comm.counter
    if delta is not None and c.recv_bytes + c.send_bytes != delta.wire_bytes:
        raise RuntimeError(
            f"weight sync: rank {comm.rank}'s delta codec counted {delta.wire_bytes} bytes, "
            f"its communicator {c.recv_bytes + c.send_bytes}"
        )
    return TransitionStats(
        POOL,
        c.recv_bytes,
        c.send_bytes,
        c.recv_bytes,
        seconds,
        False,
        dict(c.recv_from),
        c.calls,
        delta=delta,
    )
