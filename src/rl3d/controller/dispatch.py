"""How a worker method's input is split over ranks and its output collected.

A worker method declares its mode with `@register(Dispatch.X)`:
- ONE_TO_ALL: every rank gets the same arguments; the output of any rank is the result (the
  method must compute the same thing everywhere, or return None where it has nothing).
- DP_COMPUTE: the batch is split into `dp_size` equal chunks, one per rank of a pure data-
  parallel group; every rank's output is collected, in rank order.
- MEGATRON_COMPUTE: the batch is split over the data-parallel ranks of a megatron grid; the
  output is collected from tp = 0 on the last pipeline stage of each DP rank.

A worker tells where it sits with `dispatch_info()`. Two backends implement the protocol:
`SPMDWorkerGroup` here (every rank runs the controller; collection is a collective) and the
Ray backend (a driver collects through the object store). The RL loop only ever calls
`group.call("method", batch)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch.distributed as dist

from rl3d.controller.batch import DataBatch

DISPATCH_ATTR = "__rl3d_dispatch__"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    MEGATRON_COMPUTE = "megatron_compute"


def register(mode: Dispatch) -> Callable:
    """Decorator: declare a worker method's dispatch mode."""

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, Dispatch(mode))
        return fn

    return mark


def dispatch_mode(method: Callable) -> Dispatch:
    return getattr(method, DISPATCH_ATTR, Dispatch.ONE_TO_ALL)


@dataclass(frozen=True)
class DispatchInfo:
    dp_rank: int
    dp_size: int
    is_collector: bool  # MEGATRON_COMPUTE: tp == 0 on the last pipeline stage


class Worker(Protocol):
    def dispatch_info(self) -> DispatchInfo: ...


def split_for(mode: Dispatch, info: DispatchInfo, batch: DataBatch) -> DataBatch:
    if mode is Dispatch.ONE_TO_ALL:
        return batch
    return batch.split(info.dp_size)[info.dp_rank]


def merge_outputs(outputs: list[Any]) -> Any:
    """Collected outputs in DP order -> one result: batches concatenate, metric dicts average."""
    outputs = [o for o in outputs if o is not None]
    if not outputs:
        return None
    first = outputs[0]
    if isinstance(first, DataBatch):
        return DataBatch.concat(outputs)
    if isinstance(first, dict):
        keys = {k for o in outputs for k in o}
        return {
            k: sum(float(o[k]) for o in outputs if k in o) / sum(1 for o in outputs if k in o) for k in keys
        }
    return outputs


class SPMDWorkerGroup:
    """The default backend: the controller runs on every rank of `group` (None = the world).

    With own resource pools (`rl3d.controller.spmd_pools`) `worker` is None on the ranks of
    other pools, and `channel` carries the collection across pools: the role's ranks compute,
    every rank gets the result."""

    def __init__(self, worker: Worker | None, *, role: str, group: Any = None, channel: Any = None):
        self.worker, self.role, self.group, self.channel = worker, role, group, channel

    def _method(self, method_name: str) -> Callable:
        method = getattr(self.worker, method_name, None)
        if method is None:
            raise AttributeError(f"{self.role} worker has no method {method_name!r}")
        return method

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        if self.channel is not None:
            return self._call_across_pools(method_name, *args, **kwargs)
        method = self._method(method_name)
        mode = dispatch_mode(method)
        info = self.worker.dispatch_info()
        if mode is Dispatch.ONE_TO_ALL:
            return method(*args, **kwargs)
        batch, rest = args[0], args[1:]
        out = method(split_for(mode, info, batch), *rest, **kwargs)
        collect = mode is Dispatch.DP_COMPUTE or info.is_collector
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (info.dp_rank, out if collect else None), group=self.group)
        ordered = [o for _, o in sorted(((r, o) for r, o in gathered if o is not None), key=lambda x: x[0])]
        return merge_outputs(ordered)

    def _call_across_pools(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        mine: tuple | None = None  # (kind, dp rank, output) from the ranks that report
        if self.worker is not None:
            try:
                method = self._method(method_name)
                mode, info = dispatch_mode(method), self.worker.dispatch_info()
                if mode is Dispatch.ONE_TO_ALL:
                    out = method(*args, **kwargs)
                    mine = ("one", 0, out) if dist.get_rank() == 0 else None
                else:
                    out = method(split_for(mode, info, args[0]), *args[1:], **kwargs)
                    if mode is Dispatch.DP_COMPUTE or info.is_collector:
                        mine = ("part", info.dp_rank, out)
            except Exception as err:
                self.channel.all_gather_object(("error", self.channel.rank, f"{type(err).__name__}: {err}"))
                raise
        parts = [p for p in self.channel.all_gather_object(mine) if p is not None]
        errors = [p for p in parts if p[0] == "error"]
        if errors:
            _, rank, message = errors[0]
            raise RuntimeError(f"{self.role}.{method_name} failed on world rank {rank}: {message}")
        if parts and parts[0][0] == "one":
            return parts[0][2]
        return merge_outputs([o for _, _, o in sorted(parts, key=lambda p: p[1])])
