"""A megatron role's training state moved to host memory while the rollout engine generates,
and back, bit for bit.

    offload = Offload(ddp, optimizer, kinds=("params", "grads", "optimizer"), device=device)
    freed = offload.to_host()     # bytes no longer held on the device
    ...                           # generate
    offload.to_device()           # every tensor as it was, byte for byte

What each kind holds:
- `params`: the model's parameters (megatron's contiguous param buffer where it has one);
- `grads`: megatron DDP's fp32 gradient buffers (every `main_grad` is a view of them);
- `optimizer`: the optimizer's own tensors: fp32 master copies (those that are not the model's
  parameters themselves, as they are in fp32 training) and Adam's states.

Each storage is copied whole into a host buffer (pinned on CUDA, kept for the next round), then
resized to zero bytes in place: the tensors, views and megatron's bucket views that point at it
stay valid objects and see the same bytes again once it is resized back and refilled. Nothing
may read the tensors in between (the role reloads before any use).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
OFFLOAD_KINDS = ("params", "grads", "optimizer")


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    host: torch.Tensor | None = None  # uint8 [nbytes], allocated at the first offload


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (its current size)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside megatron's (chained, mixed-precision or distributed) one."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def kind_tensors(ddp: Any, optimizer: Any, kind: str) -> Iterator[torch.Tensor]:
    """The tensors of one kind (views may repeat a storage; `Offload` counts each storage once)."""
    if kind == "params":
        yield from (p.data for p in ddp.parameters())
    elif kind == "grads":
        # megatron DDP's lists of buffers (an unwrapped model's `buffers` is nn.Module's method)
        for name in ("buffers", "expert_parallel_buffers"):
            for buffer in getattr(ddp, name, None) if isinstance(getattr(ddp, name, None), list) else []:
                if buffer.grad_data is not None:
                    yield buffer.grad_data
    elif kind == "optimizer":
        for opt in _optimizers(optimizer):
            for group in opt.param_groups:
                yield from (p.data for p in group["params"])
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    else:
        raise ValueError(f"offload: unknown kind {kind!r}; known: {', '.join(OFFLOAD_KINDS)}")


class Offload:
    """The storages of `kinds` of one role on `device`, movable to the host and back."""

    def __init__(self, ddp: Any, optimizer: Any, *, kinds: Iterable[str], device: torch.device):
        self.ddp, self.optimizer = ddp, optimizer
        self.device = torch.device(device)
        self.kinds = tuple(kinds)
        self.on_host = False
        self._held: list[_Held] = []

    def _collect(self) -> list[_Held]:
        """The storages of `kinds`, each once, found anew (Adam makes its states at the first
        step); host buffers of the previous round are kept where the sizes still match."""
        held, seen = [], set()
        # params first: an fp32 optimizer's "master" parameters are the model's own, and count
        # as params (moved only when params are)
        for kind in OFFLOAD_KINDS:
            for t in kind_tensors(self.ddp, self.optimizer, kind):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in seen or t.device.type != self.device.type or storage.nbytes() == 0:
                    continue
                seen.add(key)
                if kind in self.kinds:
                    held.append(_Held(storage, storage.nbytes(), kind))
        if [(h.kind, h.nbytes) for h in held] == [(h.kind, h.nbytes) for h in self._held]:
            for new, old in zip(held, self._held):
                new.host = old.host
        return held

    def device_bytes(self) -> dict[str, int]:
        """Bytes each kind holds on the device now."""
        out = dict.fromkeys(self.kinds, 0)
        for h in self._held if self.on_host else self._collect():
            out[h.kind] += h.storage.nbytes()
        return out

    def to_host(self) -> int:
        """Copy every storage to the host and free it on the device; the bytes freed."""
        if self.on_host or not self.kinds:
            return 0
        pin = self.device.type == "cuda"
        self._held = self._collect()
        freed = 0
        for h in self._held:
            if h.host is None:
                h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=pin)
            h.host.copy_(_bytes_of(h.storage))  # blocking: the bytes are on the host after this
            h.storage.resize_(0)
            freed += h.nbytes
        self.on_host = True
        logger.debug("offloaded %s: %d bytes", ",".join(self.kinds), freed)
        return freed

    def to_device(self) -> None:
        """Reallocate every storage on the device and refill it from the host copy."""
        if not self.on_host:
            return
        for h in self._held:
            h.storage.resize_(h.nbytes)
            _bytes_of(h.storage).copy_(h.host, non_blocking=True)  # stream-ordered before any use
        self.on_host = False
