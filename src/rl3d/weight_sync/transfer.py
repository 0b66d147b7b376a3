"""Run a weight-sync plan: training ranks send buckets, rollout ranks receive and convert.

The actor's pool and the rollout pool are separate torch.distributed worlds (their megatron
grids differ), so the transfer runs on its own process group, `WeightBridge`, made at pool
set-up from the TCPStore the pools already share (`rl3d.single_controller.spmd_pools`). It spans
the actor pool's ranks (bridge ranks 0 .. n-1, in pool order) and the rollout pool's (n ..).
It is a real tensor transfer (gloo on CPU, NCCL on GPU), point to point per bucket: a weight
sync of a 7B model does not fit through a key-value store, and a broadcast would send every
rollout rank the shards of the other generation-TP ranks too.

Both kinds of group wait `rollout.async.timeout_s` for the other side (NCCL's own default is
10 minutes). `weight_sync/seconds` stops once the transfer is complete: on NCCL `wait()` only
orders the device stream, so the clock stops after the device is synchronized too.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl3d.ops.layouts import merge_tp_shards, shard_for_tp
from rl3d.utils.device import synchronize
from rl3d.weight_sync.plan import Route, SyncPlan


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes this rank sent (training) or received (rollout)
    seconds: float
    num_sends: int

    def metrics(self) -> dict[str, float]:
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/seconds": self.seconds}


class WeightBridge:
    """A process group over both pools' ranks, built directly on the shared store (the pools'
    default groups are their own worlds, so `dist.new_group` cannot span them)."""

    def __init__(self, store: Any, *, rank: int, num_train: int, num_rollout: int, device, timeout_s: float):
        self.rank, self.num_train, self.num_rollout = rank, num_train, num_rollout
        self.device = torch.device(device)
        size = num_train + num_rollout
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("weight_sync/", store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def train_rank(self, pool_rank: int) -> int:
        return pool_rank

    def rollout_rank(self, pool_rank: int) -> int:
        return self.num_train + pool_rank

    def complete(self, works: list[Any]) -> None:
        """Return once every transfer in `works` is done on this rank's device, not merely queued."""
        for work in works:
            work.wait()
        synchronize(self.device)


def send_weights(
    bridge: WeightBridge, plan: SyncPlan, shards: dict[str, torch.Tensor], pool_rank: int
) -> SyncStats:
    """On a training rank: send every bucket of every route from this rank (blocking until all
    are taken). `shards`: the rank's training shards by global name (`global_shards()`)."""
    start, sent, works = time.perf_counter(), 0, []
    for route in plan.routes_from(pool_rank):
        for tag, (lo, hi) in enumerate(route.buckets):
            flat = torch.cat([shards[p.name].detach().reshape(-1) for p in route.pieces[lo:hi]])
            works.append(bridge.pg.send([flat], bridge.rollout_rank(route.dst), tag))
            sent += flat.numel() * flat.element_size()
    bridge.complete(works)
    return SyncStats(sent, time.perf_counter() - start, len(works))


def receive_weights(
    bridge: WeightBridge, plan: SyncPlan, pool_rank: int, *, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], SyncStats]:
    """On a rollout rank: receive this rank's routes into fresh buffers and build its
    generation-TP shard of every parameter (name -> tensor, what the torch engine loads)."""
    start, received, works, views = time.perf_counter(), 0, [], []
    for route in plan.routes_to(pool_rank):
        for tag, (lo, hi) in enumerate(route.buckets):
            pieces = route.pieces[lo:hi]
            buf = torch.empty(sum(p.numel for p in pieces), dtype=dtype, device=bridge.device)
            works.append(bridge.pg.recv([buf], bridge.train_rank(route.src), tag))
            received += buf.numel() * buf.element_size()
            views.append((route, pieces, buf))
    bridge.complete(works)
    got: dict[str, dict[int, tuple[Any, torch.Tensor]]] = {}
    for _route, pieces, buf in views:
        offset = 0
        for p in pieces:
            got.setdefault(p.name, {})[p.train_tp] = (p.kind, buf[offset : offset + p.numel].view(p.shape))
            offset += p.numel
    return _to_generation(got, plan, pool_rank), SyncStats(received, time.perf_counter() - start, len(works))


def _to_generation(got: dict, plan: SyncPlan, pool_rank: int) -> dict[str, torch.Tensor]:
    t, t_g, a = plan.train.t, plan.gen_tp, pool_rank % plan.gen_tp
    out = {}
    for name, by_tp in got.items():
        kind = next(iter(by_tp.values()))[0]
        merged = merge_tp_shards([by_tp[i][1] for i in sorted(by_tp)], kind)
        if t_g > t:
            merged = shard_for_tp(merged, kind, t_g // t, a % (t_g // t))
        out[name] = merged
    return out


def routes_summary(routes: list[Route]) -> str:
    return ", ".join(f"{r.src}->{r.dst}: {r.numel} elems in {len(r.buckets)} buckets" for r in routes)
