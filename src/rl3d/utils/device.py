"""The device module: every device decision and every CUDA entry point of rl3d goes through here.

- The configured device decides (`launch.device`), never the mere presence of a GPU: a CPU run
  on a GPU host stays on gloo and the local layer spec.
- A CUDA rank binds to its local GPU (`LOCAL_RANK`) before its process group exists, and passes
  it as `device_id`, so NCCL and object collectives never all land on cuda:0.
- Tensors for a collective are made on the group's device (`collective_device`).
- What a worker returns crosses to the controller on the host
  (`rl3d.single_controller.batch.to_host`, applied by every worker-group backend).

`tests/unit/test_device_discipline.py` checks the source for CUDA entry points outside this
module and a few others with a reason.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(requested: str) -> str:
    """`launch.device` ("auto" | "cpu" | "cuda") -> "cpu" or "cuda" for this host."""
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    if requested == "cuda" and not cuda_available():
        raise RuntimeError("launch.device = cuda, but this host has no usable CUDA device")
    return requested


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_process_group(device: str, *, timeout_s: float, **kwargs: Any) -> None:
    """The process group of a rank that computes on `device`: NCCL bound to the local GPU, or
    gloo. `kwargs` go to `torch.distributed.init_process_group` (store, rank, world_size...)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        index = local_rank()
        torch.cuda.set_device(index)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", index), **kwargs)
    else:
        dist.init_process_group("gloo", timeout=timeout, **kwargs)


def device_of_backend(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective on `group` must live (its backend's device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def current_gpu() -> int:
    """The bound GPU's index (0 where there is none: a CPU-only caller's default)."""
    return torch.cuda.current_device() if cuda_available() else 0


def empty_cache() -> None:
    """Hand the blocks the caching allocator holds back to the driver (another engine in this
    process, e.g. SGLang on resume, can then map them)."""
    if cuda_available():
        torch.cuda.empty_cache()


def device_total_bytes() -> int:
    """Total memory of this process's GPU (the memory plan's device size on a CUDA host)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
