"""One dispatch point per resharding op: CUDA extension, Triton kernel or torch reference.

`backend=` on a call, else the environment variable RL3D_KERNEL_BACKEND, picks the form:
- "auto" (default): on CUDA tensors the CUDA extension if built, else Triton if importable, else
  torch; on any other device the torch reference.
- "torch", "triton", "cuda": force that form, for tests and benchmarks. Triton on CPU tensors
  needs TRITON_INTERPRET=1; forcing a form that cannot run raises instead of falling back.

Nothing here imports triton or builds the CUDA extension until a call chooses that form.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence
from enum import Enum
from types import ModuleType

import torch

from rl3d.ops.gather import (
    GatheredShards,
    ParamLayout,
    check_gather_args,
    num_shards_of,
    output_shape,
    shard_shape_of,
    split_hf,
)

BACKEND_ENV = "RL3D_KERNEL_BACKEND"


class Backend(str, Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CUDA = "cuda"


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _cuda_ext_available() -> bool:
    import rl3d.ops.cuda_ext as cuda_ext

    return cuda_ext.available()


def resolve_backend(requested: Backend | str | None, device: torch.device) -> Backend:
    """The form that runs for tensors on `device`; raises if a forced form cannot run there."""
    source = "backend="
    if requested is None:
        requested, source = os.environ.get(BACKEND_ENV, "auto"), BACKEND_ENV
    try:
        backend = Backend(str(getattr(requested, "value", requested)).lower())
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"{source}{requested!r} is not a kernel backend ({choices})") from None
    on_cuda = device.type == "cuda"
    if backend is Backend.AUTO:
        if on_cuda and _cuda_ext_available():
            return Backend.CUDA
        if on_cuda and triton_importable():
            return Backend.TRITON
        return Backend.TORCH
    if backend is Backend.TRITON:
        if not triton_importable():
            raise RuntimeError("kernel backend 'triton' forced, but triton is not installed")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernel backend 'triton' forced for {device.type} tensors: set TRITON_INTERPRET=1 "
                "before triton is imported to run Triton kernels on the CPU"
            )
    if backend is Backend.CUDA:
        if not on_cuda:
            raise RuntimeError(f"kernel backend 'cuda' forced for {device.type} tensors")
        if not _cuda_ext_available():
            raise RuntimeError(
                "kernel backend 'cuda' forced, but the rl3d CUDA extension is neither built nor "
                "JIT-buildable here (see the rl3d.ops.cuda_ext log)"
            )
    return backend


def _form(backend: Backend) -> ModuleType:
    names = {Backend.TORCH: "reference", Backend.TRITON: "triton_ops", Backend.CUDA: "cuda_ext"}
    return importlib.import_module(f"rl3d.ops.{names[backend]}")


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"rl3d.ops: tensors are on several devices: {sorted(map(str, devices))}")
    return devices.pop()


def strided_copy(
    src: torch.Tensor, dst: torch.Tensor, *, backend: Backend | str | None = None
) -> torch.Tensor:
    """`dst.copy_(src)` for equal shapes, any strides on either side, with a dtype cast: how weights
    go straight into a slice of an engine's own parameter without an intermediate full copy.
    `src` and `dst` must not overlap."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"strided_copy: shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}")
    _form(resolve_backend(backend, _device_of([src, dst]))).strided_copy_into(src, dst)
    return dst


def bucket_numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def pack_bucket(
    tensors: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """Flatten `tensors` one after another into one contiguous 1-D send buffer, cast to `dtype`
    (e.g. fp32 master weights -> bf16 for rollout). Writes the front of `out` if given; returns
    the packed [bucket_numel] view."""
    if not tensors:
        raise ValueError("pack_bucket: no tensors")
    if dtype is None:
        dtypes = {t.dtype for t in tensors} if out is None else {out.dtype}
        if len(dtypes) != 1:
            raise ValueError(f"pack_bucket: tensors mix dtypes {sorted(map(str, dtypes))}; pass dtype=")
        dtype = dtypes.pop()
    total = bucket_numel(tensors)
    if out is None:
        out = torch.empty(total, dtype=dtype, device=tensors[0].device)
    if out.dim() != 1 or not out.is_contiguous() or out.numel() < total or out.dtype != dtype:
        raise ValueError(
            f"pack_bucket: out must be a contiguous 1-D {dtype} tensor of at least {total} elements, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    bucket = out[:total]
    _form(resolve_backend(backend, _device_of([*tensors, out]))).pack_bucket_into(tensors, bucket)
    return bucket


def unpack_bucket(
    bucket: torch.Tensor,
    destinations: Sequence[torch.Tensor],
    *,
    backend: Backend | str | None = None,
) -> Sequence[torch.Tensor]:
    """The inverse of `pack_bucket`: consecutive slices of `bucket` into `destinations` (any
    strides, e.g. an engine's parameters), each cast to its destination's dtype."""
    total = bucket_numel(destinations)
    if bucket.dim() != 1 or not bucket.is_contiguous() or bucket.numel() < total:
        raise ValueError(
            f"unpack_bucket: bucket must be a contiguous 1-D tensor of at least {total} elements, "
            f"got {tuple(bucket.shape)}"
        )
    device = _device_of([bucket, *destinations])
    _form(resolve_backend(backend, device)).unpack_bucket_into(bucket, destinations)
    return destinations


def gather_to_layout(
    shards: Sequence[torch.Tensor] | GatheredShards,
    layout: ParamLayout,
    *,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str = "megatron",
    out: torch.Tensor | None = None,
    backend: Backend | str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The gathered training-TP shards of one parameter -> generation-TP shard `gen_rank`.

    `shards` are training ranks gen_rank*r .. gen_rank*r + r - 1 (r = train_tp/gen_tp), as tensors
    or as a window of the all-gather buffer (`GatheredShards`, no extra copy); see
    `rl3d.ops.gather` for the KV-replicated case gen_tp > train_tp. Writes one fused tensor (`out`
    if given: any strides, e.g. an engine parameter; its dtype may differ; it must not overlap the
    shards). target="megatron" returns it; target="hf" returns its HF pieces as views: (q, k, v),
    (gate, up) or (weight,).
    """
    num_shards = num_shards_of(shards)
    shard_shape = shard_shape_of(shards)
    check_gather_args(layout, shard_shape, num_shards, train_tp, gen_tp, gen_rank, target)
    shape = output_shape(layout, shard_shape, num_shards, train_tp, gen_tp, gen_rank, target)
    sources = [shards.buffer] if isinstance(shards, GatheredShards) else list(shards)
    if out is None:
        out = torch.empty(shape, dtype=sources[0].dtype, device=sources[0].device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"gather_to_layout: out has shape {tuple(out.shape)}, expected {shape}")
    _form(resolve_backend(backend, _device_of([*sources, out]))).gather_to_layout_into(
        shards, layout, train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target, out=out
    )
    return split_hf(out, layout, gen_tp) if target == "hf" else out
