"""The pure parts of the SGLang adapter: version/API checks, Megatron -> HF tensors, buckets.

Nothing here imports SGLang, so all of it is tested on CPU. SGLang's weight loaders take whole
HF tensors (each SGLang TP rank slices its own part), so the generation-TP shards of a parameter
are all-gathered and converted to HF names and layout by the resharding kernels
(`rl3d.ops.gather_to_layout(target="hf")`), then flattened into buckets whose metadata has the
fields of SGLang's `FlattenedTensorMetadata` (`load_format="flattened_bucket"`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.models.builder import megatron_param_kinds
from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.spec import ModelSpec
from rl3d.ops import ParamLayout, gather_to_layout, pack_bucket
from rl3d.ops.layouts import ShardKind

SGLANG_VERSION = "0.5.23"  # keep equal to the `[gpu]` extra's pin in setup.py

# Engine methods the adapter calls, with the keyword arguments it passes to each.
REQUIRED_ENGINE_API: dict[str, tuple[str, ...]] = {
    "generate": ("input_ids", "sampling_params", "return_logprob"),
    "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache"),
    "init_weights_update_group": (
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "flush_cache": (),
    "shutdown": (),
}


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version (or API) rl3d's adapter was written against."""


def check_sglang_version(version: str, required: str = SGLANG_VERSION) -> None:
    """`version` must be `required` (a local label such as "+cu128" is allowed, as pip's
    `==` allows it)."""
    from packaging.version import InvalidVersion, Version

    try:
        found = Version(version)
    except InvalidVersion as err:
        raise SGLangVersionError(f"SGLang reports an unparsable version {version!r}") from err
    if found.public != Version(required).public:
        raise SGLangVersionError(
            f"SGLang {version} is installed, but rl3d's SGLang adapter needs sglang=={required} "
            f"(install it with `pip install 'rl3d[gpu]'` or `pip install sglang=={required}`)"
        )


def check_engine_api(engine_cls: Any, required: dict[str, tuple[str, ...]] = REQUIRED_ENGINE_API) -> None:
    """Every method the adapter calls exists and accepts the keywords it passes; one error lists
    every mismatch."""
    problems = []
    for method, keywords in required.items():
        fn = getattr(engine_cls, method, None)
        if fn is None or not callable(fn):
            problems.append(f"Engine.{method} is missing")
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing to check
        names = set(sig.parameters)
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        missing = [k for k in keywords if k not in names and not takes_kwargs]
        if missing:
            problems.append(f"Engine.{method}{sig} lacks keyword(s) {', '.join(missing)}")
    if problems:
        raise SGLangVersionError(
            "the installed SGLang Engine does not match the API rl3d's adapter uses "
            f"(written for sglang=={SGLANG_VERSION}):\n  " + "\n  ".join(problems)
        )


def check_sglang(module: Any) -> None:
    """Version and Engine API of an imported `sglang` module."""
    check_sglang_version(getattr(module, "__version__", "unknown"))
    check_engine_api(module.Engine)


# -- Megatron -> HF ----------------------------------------------------------------------------
def hf_names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Megatron global name -> the HF names its tensors get (output layer absent when tied)."""
    return {m.mcore: m.hf for m in tensor_maps(spec, padded_vocab=0)}


def megatron_to_hf(spec: ModelSpec, name: str, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """All TP shards of Megatron parameter `name` (in TP order; one tensor for a replicated or
    unsharded one) -> its whole HF tensors with their names, vocab padding removed."""
    kind = megatron_param_kinds(spec)[name]
    names = hf_names(spec)[name]
    if kind is ShardKind.REPLICATED:
        tensors = (shards[0],)
    else:
        layout = ParamLayout(
            kind=kind,
            num_heads=spec.num_attention_heads if kind is ShardKind.QKV else 0,
            num_query_groups=spec.num_query_groups if kind is ShardKind.QKV else 0,
            vocab_size=spec.vocab_size if kind is ShardKind.VOCAB else 0,
        )
        tensors = gather_to_layout(shards, layout, train_tp=len(shards), gen_tp=1, gen_rank=0, target="hf")
    assert len(tensors) == len(names), (name, len(tensors), names)
    return list(zip(names, tensors))


def hf_tensors(spec: ModelSpec, weights: Any, comm: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole HF tensors of every parameter of a rank's `GenerationWeights`, one parameter at a
    time. With a generation-TP group (`rl3d.rollout.model.TPComm`, size > 1) this is collective:
    the group all-gathers each sharded parameter."""
    size = 1 if comm is None else comm.size
    for name in weights.names():
        if name == "output_layer.weight" and spec.tied_embeddings:
            continue  # SGLang ties lm_head to the embedding itself
        shard = weights.materialize(name)  # this rank's Megatron generation shard
        shards = [shard]
        if size > 1 and weights.params[name].kind is not ShardKind.REPLICATED:
            import torch.distributed as dist

            shards = [torch.empty_like(shard) for _ in range(size)]
            dist.all_gather(shards, shard.contiguous(), group=comm.handle)
        yield from megatron_to_hf(spec, name, shards)


# -- buckets -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a flat bucket (the fields of SGLang's FlattenedTensorMetadata)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors, in order, into buckets of at most `bucket_bytes` and one
    dtype each (a tensor larger than the limit is a bucket alone). Lazy: a bucket is yielded as
    soon as it is full, so only one bucket of tensors is alive at a time."""
    if bucket_bytes < 1:
        raise ValueError(f"rollout.sglang.bucket_mb must be > 0, got {bucket_bytes} bytes")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[BucketEntry]]:
    """One contiguous 1-D tensor holding the bucket's tensors back to back (rl3d.ops.pack_bucket),
    and where each one lies."""
    flat = pack_bucket([t for _, t in bucket])
    entries, cursor = [], 0
    for name, t in bucket:
        entries.append(BucketEntry(name, t.shape, t.dtype, cursor, cursor + t.numel(), t.numel()))
        cursor += t.numel()
    return flat, entries


def unflatten_bucket(flat: torch.Tensor, entries: list[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `flatten_bucket` (views), as SGLang's loader rebuilds the tensors."""
    return [(e.name, flat[e.start_idx : e.end_idx].view(e.shape)) for e in entries]


def to_sglang_sampling(params: Any, sample_index: int) -> dict[str, Any]:
    """SGLang's per-request sampling dict for sample `sample_index` of a `SamplingParams`."""
    out: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": False,
    }
    if params.seed is not None:
        out["sampling_seed"] = (params.seed * 1_000_003 + sample_index) % (2**31 - 1)
    return out
