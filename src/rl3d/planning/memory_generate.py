"""Bytes the rollout engine holds on one rank around generation: from shapes alone.

- weights: the engine's own copy in the generation layout. rl3d's torch engine reads the
  resharded training weights in place (0 here) unless `rollout.dtype` differs from
  `model.dtype` (then a cast copy); SGLang always loads its own copy.
- resharded: the generation weights the 3D-HybridEngine builds beyond the training shard the
  rank already holds (`rl3d.hybrid_engine.plan`: peak + redundant - training bytes; 0 for
  hybridflow's identity transition). The torch engine generates on it; SGLang has copied it
  once its push is done, so the generate phase counts it for the torch engine only.
- kv_cache: K and V at full length (`data.max_prompt_length + rollout.max_new_tokens`
  tokens). The torch engine allocates it for the rows it decodes at once (`max_batch_rows` per
  chunk of the rank's share of the step). SGLang decodes as many sequences as its pool holds:
  with a device size its pool is what the phase leaves free, at most the rank's whole share at
  once and at least one full-length sequence (`sglang_pool`); without one, the whole share.
- workspace: one layer's forward over a prefill (the torch engine's chunk of prompts, or
  SGLang's `CHUNKED_PREFILL_TOKENS`) plus fp32 logits of the decoded rows; for SGLang also
  `SGLANG_GRAPH_BYTES`, the CUDA graphs it captures before it sizes its pool.
- buffers: the resharding bucket (`hybrid_engine.bucket_mb`) and what SGLang's push holds at
  its peak (`EnginePush.peak_bytes` of the planned push: its largest bucket, which is more than
  `rollout.sglang.bucket_mb` where one tensor, e.g. the embedding, exceeds it, twice, plus one
  parameter's gathered shards at t_g > 1), held only while weights move (the reshard phase).

On a GPU (a plan with a device size) every phase also holds what no tensor counts
(`DeviceBytes`): a CUDA context per process on the device (the trainer's, and SGLang's
scheduler's beside it), the trainer's NCCL communicators, and a stated share of the
allocator's bytes lost to fragmentation. Each is an allowance, named as one below; the device
script (`benchmarks/device_check.py`) measures them against `mem_get_info`.

SGLang sizes its KV pool itself, once, at launch (sglang 0.5.23,
`model_executor/model_runner_components/kv_pool_runtime.py`): with B the free memory before it
loads its weights, the pool is what is free after its weights and CUDA graphs less a headroom
of B x (1 - `mem_fraction_static`), i.e. B x `mem_fraction_static` - weights - graphs, and
`max_total_tokens` only caps that (`sglang_pool`). The trainer's optimizer state exists by then
(`rl3d.models.training.make_optimizer_state`), so B is the device less every role's static bytes,
the contexts and NCCL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rl3d.config.schema import RL3DConfig
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.hybrid_engine.engine_push import EnginePush, plan_engine_push
from rl3d.models.params import model_params, stages_of
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import padded_vocab_size
from rl3d.planning.memory_activations import layer_bytes
from rl3d.planning.memory_train import FP32, ByteItems, local_numel, model_inventory
from rl3d.utils.dtypes import DTYPE_BYTES

MB = 1 << 20
TORCH_MAX_BATCH_ROWS = 256  # TorchRolloutEngine's default max_batch_rows
CHUNKED_PREFILL_TOKENS = 8192  # SGLang's chunked_prefill_size on an 80 GB-class GPU
SGLANG_GRAPH_BYTES = 1 << 30  # an allowance, not a measurement: SGLang's captured CUDA graphs
CUDA_CONTEXT_BYTES = 512 * MB  # an allowance per process: a CUDA context with lazy module loading
NCCL_BYTES = 1 << 30  # an allowance per rank with peers: the trainer's NCCL communicators' buffers
FRAGMENTATION = 0.05  # a stated share of the allocator's bytes held in blocks it cannot reuse


@dataclass(frozen=True)
class EngineBytes(ByteItems):
    weights: int = 0
    resharded: int = 0
    kv_cache: int = 0
    workspace: int = 0
    buffers: int = 0


@dataclass(frozen=True)
class SyncBytes(ByteItems):
    """A training rank's weight-sync state for a separate rollout pool, held through the run:
    with `rollout.weight_update: delta` the buckets it last sent, to diff the next sync against
    (what the plan has it send per sync, `rl3d.weight_sync.delta`)."""

    previous: int = 0


@dataclass(frozen=True)
class DeviceBytes(ByteItems):
    """What a GPU holds in a phase besides the planned tensors (see the module docstring)."""

    contexts: int = 0
    nccl: int = 0
    fragmentation: int = 0


def device_beside(cfg: RL3DConfig, *, processes: int, allocated: int) -> DeviceBytes:
    """The contexts of `processes` processes, NCCL where the run has more than one rank, and
    the fragmentation share of `allocated` bytes."""
    return DeviceBytes(
        contexts=processes * CUDA_CONTEXT_BYTES,
        nccl=NCCL_BYTES if cfg.launch.world_size > 1 else 0,
        fragmentation=int(allocated * FRAGMENTATION),
    )


@dataclass(frozen=True)
class GenShape:
    """One rank's place in the generation layout."""

    tp: int
    pp: int
    pp_rank: int
    dp_size: int  # generation data-parallel engines over the whole step
    train_tp: int  # the vocabulary is padded for the training TP size


def gen_weight_numel(spec: ModelSpec, shape: GenShape) -> int:
    vocab = padded_vocab_size(spec.vocab_size, shape.train_tp)
    params = model_inventory(spec, "actor", vocab)
    return sum(
        local_numel(p, shape.tp) for p in params if shape.pp_rank in stages_of(p, spec.num_layers, shape.pp)
    )


def _sequences(cfg: RL3DConfig, shape: GenShape) -> tuple[int, int]:
    """(rows decoded at once, slots per row) on one generation rank."""
    n = cfg.rollout.n
    samples = math.ceil(cfg.data.prompts_per_step / shape.dp_size) * n
    if cfg.rollout.engine == "torch":
        samples = min(samples, max(1, TORCH_MAX_BATCH_ROWS // n) * n)
    return samples, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def kv_cache_bytes(cfg: RL3DConfig, spec: ModelSpec, shape: GenShape, dtype_bytes: int) -> int:
    rows, slots = _sequences(cfg, shape)
    return rows * sequence_kv_bytes(cfg, spec, shape, dtype_bytes)


def sequence_kv_bytes(cfg: RL3DConfig, spec: ModelSpec, shape: GenShape, dtype_bytes: int) -> int:
    """K and V of one full-length sequence on one generation rank."""
    slots = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    layers = spec.num_layers // shape.pp
    kv_heads = max(spec.num_query_groups // shape.tp, 1)
    return layers * kv_heads * 2 * spec.head_dim * slots * dtype_bytes


def workspace_bytes(cfg: RL3DConfig, spec: ModelSpec, shape: GenShape, dtype_bytes: int) -> int:
    rows, _ = _sequences(cfg, shape)
    width = cfg.data.max_prompt_length
    reserved = 0
    if cfg.rollout.engine == "sglang":
        tokens = min(CHUNKED_PREFILL_TOKENS, rows * width)
        prefill = MicroBatchShape(seq_len=tokens, rows=1, response_len=0, flash=True)
        reserved = SGLANG_GRAPH_BYTES
    else:
        prefill = MicroBatchShape(
            seq_len=width, rows=max(1, rows // cfg.rollout.n), response_len=0, flash=False
        )
    vocab = padded_vocab_size(spec.vocab_size, shape.train_tp) // shape.tp
    return layer_bytes(spec, shape.tp, prefill, dtype_bytes) + rows * vocab * FP32 + reserved


def sglang_push(cfg: RL3DConfig, spec: ModelSpec, shape: GenShape) -> EnginePush:
    """The push to SGLang the transition plans for this generation layout (the model's dtype,
    `rollout.sglang.bucket_mb`): the same planner as `Resharder.push_plan`."""
    params = model_params(spec, train_tp=shape.train_tp)
    bucket_bytes = int(cfg.rollout.sglang.bucket_mb * MB)
    return plan_engine_push(spec, params, shape.tp, dtype=cfg.model.dtype, bucket_bytes=bucket_bytes)


def engine_bytes(
    cfg: RL3DConfig, spec: ModelSpec, shape: GenShape, *, resharded: int, colocated: bool
) -> tuple[EngineBytes, EngineBytes]:
    """(the reshard phase's engine bytes, the generate phase's) on one rank."""
    rollout = cfg.rollout
    dtype_bytes = DTYPE_BYTES[rollout.dtype or cfg.model.dtype]
    gen_numel = gen_weight_numel(spec, shape)
    sglang = rollout.engine == "sglang"
    own_copy = sglang or not colocated or (rollout.dtype not in (None, cfg.model.dtype))
    weights = gen_numel * dtype_bytes if own_copy else 0
    buffers = int(cfg.hybrid_engine.bucket_mb * MB) if colocated and resharded else 0
    if sglang:
        buffers += sglang_push(cfg, spec, shape).peak_bytes
    reshard = EngineBytes(weights=weights, resharded=resharded, buffers=buffers)
    generate = EngineBytes(
        weights=weights,
        resharded=0 if sglang else resharded,
        kv_cache=kv_cache_bytes(cfg, spec, shape, dtype_bytes),
        workspace=workspace_bytes(cfg, spec, shape, dtype_bytes),
    )
    return reshard, generate


def sglang_pool(
    cfg: RL3DConfig,
    spec: ModelSpec,
    shape: GenShape,
    generate: EngineBytes,
    *,
    others: int,
    at_launch: int,
    device_bytes: int,
) -> tuple[EngineBytes, str | None]:
    """SGLang's KV pool on a device of `device_bytes`: min(its own sizing, the cap, the rank's
    whole share). `others`: the generate phase's bytes beside the engine (roles, contexts,
    NCCL; fragmentation comes on top of everything); `at_launch`: what the device holds when
    SGLang measures it (every role's static bytes, contexts, NCCL). The cap is
    `rollout.sglang.max_total_tokens`; "plan" caps the pool at what the phase leaves free, in
    whole sequences. Also why the pool cannot work (None when it can): its own sizing holds
    no full-length sequence."""
    sg = cfg.rollout.sglang
    dtype_bytes = DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype]
    one = sequence_kv_bytes(cfg, spec, shape, dtype_bytes)
    per_token = max(one // (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens), 1)
    free_before = device_bytes - at_launch
    own = int(free_before * sg.mem_fraction_static) - generate.weights - SGLANG_GRAPH_BYTES
    own = max(own, 0) // per_token * per_token
    if sg.max_total_tokens == "plan":
        left = int(device_bytes / (1 + FRAGMENTATION)) - others - (generate.total - generate.kv_cache)
        cap = max(one, left // one * one)
    elif sg.max_total_tokens is None:
        cap = generate.kv_cache
    else:
        cap = sg.max_total_tokens * per_token
    pool = min(own, cap, generate.kv_cache)
    problem = None
    if own < one:
        problem = (
            f"SGLang's own KV pool sizing (free before launch {free_before / (1 << 30):.2f} GiB x "
            f"rollout.sglang.mem_fraction_static {sg.mem_fraction_static} - its weights "
            f"{generate.weights / (1 << 30):.2f} GiB - CUDA graphs {SGLANG_GRAPH_BYTES / (1 << 30):.2f} GiB) "
            f"holds {own // per_token} tokens, under one full-length sequence of "
            f"{one // per_token}; to fit: a larger rollout.sglang.mem_fraction_static or rollout.t_g"
        )
    return replace(generate, kv_cache=pool), problem
