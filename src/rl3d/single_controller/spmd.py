"""The default worker-group backend: torchrun starts every rank, and the controller runs on all.

Dispatch is local (every rank already holds the arguments) and collection is a collective
(of what the workers return, on the host: `to_host`):
an object all-gather over the role's world, or over the `ControllerChannel` when the role
lives in another resource pool (`rl3d.single_controller.spmd_pools`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rl3d.single_controller.batch import to_host
from rl3d.single_controller.dispatch import MODES, Worker, dispatch_mode, metrics_reduction
from rl3d.utils.device import collective_device


class SPMDWorkerGroup:
    """A role's worker group under spmd (`group`: its ranks; None = the world).

    With own resource pools `worker` is None on the ranks of other pools, and `channel`
    carries the collection across pools: the role's ranks compute, every rank gets the
    result."""

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
        mode = MODES[dispatch_mode(method)]
        if not mode.gathers:
            return to_host(method(*args, **kwargs))
        slot = mode.slot(self.worker.dispatch_info())
        out = to_host(method(mode.split(args[0], slot), *args[1:], **kwargs))
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (slot, out) if slot.collects else None, group=self.group)
        return mode.collect([p for p in gathered if p is not None], metrics_reduction(method), args[0])

    def _call_across_pools(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        # ("one", output) or ("part", slot, output, mode, reduction) from the ranks that report;
        # ranks outside the role's pool learn the method's mode from them
        mine: tuple | None = None
        if self.worker is not None:
            try:
                method = self._method(method_name)
                mode = MODES[dispatch_mode(method)]
                if not mode.gathers:
                    out = to_host(method(*args, **kwargs))
                    mine = ("one", out) if dist.get_rank() == 0 else None
                else:
                    slot = mode.slot(self.worker.dispatch_info())
                    out = to_host(method(mode.split(args[0], slot), *args[1:], **kwargs))
                    reduce = metrics_reduction(method)
                    mine = ("part", slot, out, dispatch_mode(method), reduce) if slot.collects else None
            except Exception as err:
                self.channel.all_gather_object(("error", self.channel.rank, f"{type(err).__name__}: {err}"))
                raise
        parts = [p for p in self.channel.all_gather_object(mine) if p is not None]
        errors = [p for p in parts if p[0] == "error"]
        if errors:
            _, rank, message = errors[0]
            raise RuntimeError(f"{self.role}.{method_name} failed on world rank {rank}: {message}")
        if not parts:
            return None
        if parts[0][0] == "one":
            return parts[0][1]
        _, _, _, mode_name, reduce = parts[0]
        return MODES[mode_name].collect([(slot, out) for _, slot, out, *_ in parts], reduce, args[0])


def agree(flag: bool, channel: Any = None) -> bool:
    """True on every rank once any rank's flag is set (a stop request reaches ranks at
    different moments; they agree at the step boundary so none waits in a collective alone)."""
    if channel is not None:
        return channel.any(flag)
    value = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
