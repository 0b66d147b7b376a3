"""The pure parts of the SGLang adapter: version/API checks, server args, the environment of
SGLang's processes, sampling semantics, Megatron -> HF tensors, buckets.

Nothing here imports SGLang, so all of it is tested on CPU (and checked against the pinned
wheel's source in tests/unit/rollout/test_sglang_wheel_contract.py). SGLang's weight loaders take whole
HF tensors (each SGLang TP rank slices its own part), so the generation-TP shards of a parameter
are all-gathered and converted to HF names and layout by the resharding kernels
(`rl3d.ops.gather_to_layout(target="hf")`), then flattened into buckets whose metadata has the
fields of SGLang's `FlattenedTensorMetadata` (`load_format="flattened_bucket"`). Which tensors go
in which bucket is planned with the transition (`rl3d.hybrid_engine.engine_push`); here the
planned buckets are filled (`planned_buckets`) and what was pushed is counted (`Pushed`).

A mixture of experts goes over as its HF checkpoint names, every expert under its global index
(`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, the router as `mlp.gate.weight`):
SGLang's FusedMoE loader maps the global index to its expert-parallel rank's slot and drops the
experts another rank holds (contiguous blocks of num_experts / ep experts per rank), and splits
each kept expert over its MoE TP itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
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
    "generate": ("input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "lora_path"),
    "load_lora_adapter_from_tensors": ("lora_name", "tensors", "config_dict"),
    "unload_lora_adapter": ("lora_name",),
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
    "begin_weight_update": (),  # 0.5.23: update_weights_* fail outside begin/end
    "end_weight_update": (),
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


# -- launch: server args and the environment of SGLang's processes ------------------------------
# What torchrun puts in every rank's environment. SGLang's scheduler processes inherit it: with
# TORCHELASTIC_USE_AGENT_STORE=True torch's `tcp://` rendezvous makes a client-only store that
# nobody serves (start-up hangs), and an inherited MASTER_ADDR/MASTER_PORT wins over SGLang's own
# (`os.environ.setdefault` in sglang.srt.distributed.bootstrap).
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)
# Set for SGLang's processes only: log-probs of the model's plain softmax (temperature 1, before
# top-k/top-p), as the torch engine's `raw_logprobs`; SGLang's default is log_softmax(logits / T).
SGLANG_CHILD_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def is_torchrun_var(name: str) -> bool:
    return name in TORCHRUN_VARS or name.startswith(TORCHRUN_PREFIXES)


def sglang_launch_env(parent: Mapping[str, str]) -> dict[str, str]:
    """The environment SGLang's engine is started in (its child processes inherit it): the
    parent's without the torchrun variables, plus SGLANG_CHILD_ENV."""
    env = {k: v for k, v in parent.items() if not is_torchrun_var(k)}
    env.update(SGLANG_CHILD_ENV)
    return env


def env_changes(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str | None]:
    """name -> new value (None: removed) of every variable that differs."""
    names = set(before) | set(after)
    return {k: after.get(k) for k in sorted(names) if before.get(k) != after.get(k)}


def sglang_server_args(
    *,
    model_path: str,
    tp_size: int,
    base_gpu_id: int,
    gpu_id_step: int,
    mem_fraction_static: float,
    enable_memory_saver: bool,
    deterministic: bool,
    dtype: str,
    seed: int | None = None,
    max_total_tokens: int | None = None,
) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for one generation-TP group. Token ids in and out (no tokenizer);
    sampling defaults are SGLang's own, not the checkpoint's generation_config.json (rl3d passes
    every sampling key it means); `sampling_seed` is honoured only with deterministic inference.
    The weights start as random values (`load_format="dummy"`, no read of the checkpoint):
    `load_weights` pushes every tensor before the engine may generate."""
    args: dict[str, Any] = dict(
        model_path=model_path,
        load_format="dummy",
        tp_size=tp_size,
        base_gpu_id=base_gpu_id,
        gpu_id_step=gpu_id_step,
        mem_fraction_static=mem_fraction_static,
        enable_memory_saver=enable_memory_saver,
        enable_deterministic_inference=deterministic,
        skip_tokenizer_init=True,
        sampling_defaults="openai",
        dtype=dtype,
    )
    if seed is not None:
        args["random_seed"] = seed
    if max_total_tokens is not None:  # the KV pool the memory plan leaves (rollout.sglang.max_total_tokens)
        args["max_total_tokens"] = max_total_tokens
    return args


# -- Megatron -> HF ----------------------------------------------------------------------------
def hf_names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Megatron global name -> the HF names its tensors get (output layer absent when tied)."""
    return {m.mcore: m.hf for m in tensor_maps(spec, padded_vocab=0)}


def megatron_to_hf(spec: ModelSpec, name: str, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """All TP shards of Megatron parameter `name` (in TP order; one tensor for a replicated or
    unsharded one) -> its whole HF tensors with their names, vocab padding removed."""
    kind, names = megatron_param_kinds(spec)[name], hf_names(spec)[name]
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


def gathered_shards(weights: Any, name: str, comm: Any = None) -> list[torch.Tensor]:
    """Every generation-TP shard of parameter `name` of a rank's `GenerationWeights`, in TP
    order: collective over the group of `comm` (`rl3d.rollout.model.TPComm`) when the parameter
    is sharded and the group has more than one rank; else this rank's shard alone."""
    shard = weights.materialize(name)  # this rank's Megatron generation shard
    size = 1 if comm is None else comm.size
    if size == 1 or weights.params[name].kind is ShardKind.REPLICATED:
        return [shard]
    import torch.distributed as dist

    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=comm.handle)
    return shards


# -- buckets -----------------------------------------------------------------------------------
@dataclass
class Pushed:
    """What one push handed the engine: each bucket's tensor names and bytes, in order, and the
    bytes received from the generation-TP group to make whole tensors. The hybrid engine checks
    it against the planned push (`rl3d.hybrid_engine.engine_push`)."""

    buckets: list[tuple[tuple[str, ...], int]] = field(default_factory=list)
    gather_bytes: int = 0

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        self.buckets.append((tuple(n for n, _ in bucket), nbytes))


def planned_buckets(
    spec: ModelSpec, weights: Any, buckets: Iterable[Any], comm: Any = None, pushed: Pushed | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The whole HF tensors of each planned bucket, in order (`buckets`: the transition's
    `EnginePush.buckets`, whose tensors name themselves, their Megatron `source` and `shape`).
    A parameter's shards are gathered (`gathered_shards`, collective) and converted when its
    first tensor is due; a tensor that is not the plan's raises. Lazy: one bucket of tensors,
    and the rest of one parameter's, are alive at a time. `pushed` counts the bytes gathered."""
    pending: dict[str, torch.Tensor] = {}
    for planned in buckets:
        bucket = []
        for entry in planned.tensors:
            if entry.name not in pending:
                if pending:
                    raise RuntimeError(
                        f"the planned push wants {entry.name} while {', '.join(pending)} of the "
                        "previous parameter are still unpushed: the plan and the model's HF tensors differ"
                    )
                shards = gathered_shards(weights, entry.source, comm)
                if pushed is not None:
                    pushed.gather_bytes += sum(t.numel() * t.element_size() for t in shards[1:])
                pending.update(megatron_to_hf(spec, entry.source, shards))
            tensor = pending.pop(entry.name, None)
            if tensor is None or tuple(tensor.shape) != tuple(entry.shape):
                got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
                raise RuntimeError(
                    f"the planned push has {entry.name} of shape {tuple(entry.shape)} from {entry.source}, "
                    f"whose conversion gave {got}: the plan and the model's HF tensors differ"
                )
            bucket.append((entry.name, tensor))
        yield bucket
    if pending:
        raise RuntimeError(f"HF tensors {', '.join(pending)} are in no planned bucket")


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a flat bucket (the fields of SGLang's FlattenedTensorMetadata)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


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


def to_sglang_sampling(params: Any, sample_index: int, eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """SGLang's per-request sampling dict for sample `sample_index` of a `SamplingParams`, with
    the torch engine's stopping rule: stop at `stop_token_ids` only (the run's resolved stops:
    `rollout.stop_token_ids` and, by default, the model's end ids, `rl3d.rollout.stops`).
    SGLang's `ignore_eos` turns off the stop ids as well as the model's EOS (`eos_token_ids`), so
    without stop ids it is on, and with them the model's EOS ids must be among them (else SGLang
    would stop where the torch engine does not: ValueError)."""
    stops = sorted(set(params.stop_token_ids))
    extra = sorted(set(eos_token_ids) - set(stops))
    if stops and extra:
        raise ValueError(
            f"rollout.stop_token_ids={stops}: SGLang also stops at the model's EOS ids {extra} "
            "(config.json / generation_config.json), which the torch engine does not with "
            "rollout.ignore_eos: true; add them to rollout.stop_token_ids or drop ignore_eos"
        )
    out: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": stops or None,
        "ignore_eos": not stops,
    }
    if params.seed is not None:
        out["sampling_seed"] = (params.seed * 1_000_003 + sample_index) % (2**31 - 1)
    return out
