"""The bytes a rank's role workers really hold, by the memory plan's items: what the CPU
check of the plan sums (`tests/distributed/planning`), and what a GPU session prints beside
the plan.

Every tensor is counted by its storage, once: a parameter that is a view of megatron's flat
parameter buffer counts the buffer; an fp32 master that is the parameter itself counts nothing.
"""

from __future__ import annotations

from typing import Any

import torch


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


def _inner_optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [opt.optimizer for opt in chained]


def role_held_bytes(role: Any) -> dict[str, int]:
    """{params, grads, master, optimizer} bytes one `rl3d.engine.MegatronEngine`
    holds (a frozen role: params only)."""
    params = _storages(role.model.parameters())
    out = {"params": sum(params.values()), "grads": 0, "master": 0, "optimizer": 0}
    if role.optimizer is None:
        return out
    buffers = list(role.ddp.buffers) + list(getattr(role.ddp, "expert_parallel_buffers", []))
    grads = _storages(b.grad_data for b in buffers)
    out["grads"] = sum(grads.values())
    for inner in _inner_optimizers(role.optimizer):
        mains = [p for group in inner.param_groups for p in group["params"]]
        master = {k: v for k, v in _storages(mains).items() if k not in params and k not in grads}
        out["master"] += sum(master.values())
        states = [t for p in mains for t in inner.state.get(p, {}).values() if torch.is_tensor(t)]
        out["optimizer"] += sum(_storages(states).values())
    return out


def engine_held_bytes(actor: Any) -> dict[str, int]:
    """{resharded, kv_cache} of an `ActorRolloutWorker` between `reshard` and
    `release_generation`: generation-weight storages the training parameters do not own, and
    the torch engine's KV cache."""
    weights = actor.rollout.weights
    resharded = 0 if weights is None else weights.storage_bytes(exclude=list(actor.role.model.parameters()))
    cache = getattr(actor.rollout.engine, "cache", None)
    return {"resharded": resharded, "kv_cache": cache.nbytes() if cache is not None else 0}


class SavedActivations:
    """While open, the bytes autograd saves for the backward in each forward of `model`
    (distinct storages, parameters left out); `per_forward` lists them, one per micro-batch."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.per_forward: list[int] = []
        self._seen: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._params:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _start(self, *_: Any) -> None:
        self._flush()

    def _flush(self) -> None:
        if self._seen:
            self.per_forward.append(sum(self._seen.values()))
        self._seen = {}

    def __enter__(self) -> SavedActivations:
        self._params = _storages(self.model.parameters())
        self._handle = self.model.register_forward_pre_hook(self._start)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._handle.remove()
        self._flush()
