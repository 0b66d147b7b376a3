"""Per-device memory of a run layout, as the step simulator needs it: does each pool's peak
fit, and how much KV cache is left for generation (decode runs in waves when a step's
sequences do not fit at once).

Per rank of a pool (the worst pipeline stage), for each role it hosts:
- a trained role: its parameters, fp32 gradient buffer, fp32 master copy and Adam's m and v
  (sharded over d with the distributed optimizer), as the memory plan counts them
  (`rl3d.planning.memory_train.layout_static_bytes`): with the pool's expert parallelism `ep` a
  rank holds E/ep of each layer's routed experts, their optimizer state sharded over d/ep;
- a forward-only role (reference, reward and cost models): its parameters;
- activations of the largest trained role while it trains, counted as the memory plan counts
  them (`rl3d.planning.memory_activations`: with the pool's sequence parallelism and full
  recompute per role, `PoolLayout.sequence_parallel` and `.recompute`; flash attention or
  megatron's local attention as `Workload.flash_attention` says), and with p > 1 the pipeline's
  send and receive buffers;
- generation on the actor's pool: the generation shard beyond the actor's training shard (all
  experts of the stage, TP-sharded, against the E/ep it trains), then KV.
Everything stays resident (nothing offloaded during generation), and `USABLE` of the device's
memory is available (the rest: CUDA context, NCCL buffers, fragmentation; an assumption).
"""

from __future__ import annotations

import functools
import math

from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout
from rl3d.planning.devices import DeviceClass
from rl3d.planning.memory_activations import activation_bytes, pipeline_buffer_bytes
from rl3d.planning.memory_generate import GenShape, gen_weight_numel
from rl3d.planning.memory_train import layout_static_bytes, stage_numels
from rl3d.planning.workload import ROLLOUT, TRAINED, PoolLayout, RunLayout, Workload

USABLE = 0.9
# the megatron model each role builds: a language-model head, or a value / score head
HEAD = {
    "actor": "actor",
    "reference": "actor",
    "critic": "critic",
    "cost_critic": "critic",
    "reward_model": "critic",
    "cost_model": "critic",
}


def kv_bytes_per_seq(spec: ModelSpec, t_g: int, p_g: int, w: Workload) -> float:
    heads = max(spec.num_query_groups // t_g, 1)
    return w.seq_len * 2 * heads * spec.head_dim * w.dtype_bytes * spec.num_layers / p_g


def decode_waves(
    spec: ModelSpec, seqs: int, t_g: int, p_g: int, w: Workload, kv_budget: float
) -> tuple[int, int]:
    """(waves, sequences per wave) for `seqs` sequences and `kv_budget` bytes of KV per device."""
    fit = math.floor(kv_budget / kv_bytes_per_seq(spec, t_g, p_g, w)) if kv_budget > 0 else 0
    if fit < 1 or fit >= seqs:
        return 1, seqs
    waves = math.ceil(seqs / fit)
    return waves, math.ceil(seqs / waves)


@functools.lru_cache(maxsize=4096)
def role_static_bytes(
    spec: ModelSpec,
    role: str,
    layout: ParallelLayout,
    pp_rank: int,
    dtype_bytes: int,
    distributed_optimizer: bool,
) -> int:
    """Parameters, gradient buffer, master copy and Adam states of `role` on a rank of
    `layout`'s stage `pp_rank`: the memory plan's count (frozen roles: parameters only)."""
    return layout_static_bytes(
        spec,
        HEAD[role],
        tp=layout.t,
        pp=layout.p,
        pp_rank=pp_rank,
        dp=layout.d,
        ep=layout.ep,
        dtype_bytes=dtype_bytes,
        trainable=role in TRAINED,
        distributed_optimizer=distributed_optimizer,
    ).static


def _static_bytes(pool: PoolLayout, w: Workload, pp_rank: int) -> int:
    return sum(
        role_static_bytes(w.spec(role), role, pool.layout, pp_rank, w.dtype_bytes, w.distributed_optimizer)
        for role in pool.roles
        if role != ROLLOUT and role in w.roles
    )


@functools.lru_cache(maxsize=4096)
def _gen_numel(spec: ModelSpec, gen: GenShape) -> int:
    return gen_weight_numel(spec, gen)


@functools.lru_cache(maxsize=4096)
def _train_numel(spec: ModelSpec, layout: ParallelLayout, pp_rank: int) -> int:
    return sum(stage_numels(spec, "actor", tp=layout.t, pp=layout.p, pp_rank=pp_rank, ep=layout.ep))


def generation_extra_bytes(w: Workload, run_layout: RunLayout, pool: PoolLayout, pp_rank: int) -> int:
    """The generation weights a rank of `pool` holds beyond the actor's training shard: on the
    actor's pool, its generation shard (stage pp_rank // (p / p_g), at t_g) less the training
    shard it reads in place (HybridFlow: no redundant copy); on a separate rollout pool, all of
    its generation shard."""
    actor = run_layout.pool_of("actor").layout
    if pool.name == ROLLOUT:
        gen = GenShape(tp=pool.layout.t, pp=1, pp_rank=0, dp_size=pool.layout.d, train_tp=actor.t)
        return _gen_numel(w.actor, gen) * w.dtype_bytes
    lay = pool.layout
    stage = pp_rank // (lay.p // run_layout.p_g)
    gen = GenShape(tp=run_layout.t_g, pp=run_layout.p_g, pp_rank=stage, dp_size=lay.d, train_tp=lay.t)
    return (_gen_numel(w.actor, gen) - _train_numel(w.actor, lay, pp_rank)) * w.dtype_bytes


def _activation_bytes(pool: PoolLayout, w: Workload) -> float:
    """The largest trained role's activations and pipeline buffers on its worst stage (the
    memory plan's count: `rl3d.planning.memory_activations`): the first holds min(p, m)
    micro-batches, the last the output layer. A role in the pool's `sequence_parallel` keeps
    the hidden states between the blocks split over t (its length padded to a multiple of t, as
    the models pad it); one in its `recompute` keeps only each layer's input: the pool's choice
    of techniques, each asked for its footprint (`rl3d.engine.features.Feature.footprint`)."""
    from rl3d.engine.features import Features, Footprint
    from rl3d.engine.techniques import Recompute, SequenceParallel

    lay = pool.layout
    micro = max(1, w.mini_batch_size // (lay.d * w.micro_batch_size))
    worst = 0
    for role in (r for r in pool.roles if r in TRAINED and r in w.roles):
        spec = w.spec(role)
        split = role in pool.sequence_parallel and lay.t > 1
        features = Features(
            ([SequenceParallel()] if split else []) + ([Recompute()] if role in pool.recompute else [])
        )
        # the first stage (the most micro-batches in flight) and the last (the output layer)
        for in_flight, last in ((min(lay.p, micro), lay.p == 1), (1, True)):
            plain = MicroBatchShape(
                w.seq_len, w.micro_batch_size, w.response_len, w.flash_attention, in_flight=in_flight
            )
            shape = features.footprint(Footprint(plain, tp=lay.t)).batch
            kept = activation_bytes(
                spec,
                role=role,
                tp=lay.t,
                layers=spec.num_layers // lay.p,
                first_layer=(lay.p - 1) * (spec.num_layers // lay.p) if last else 0,
                last_stage=last,
                lm_head=role == "actor",
                shape=shape,
                dtype_bytes=w.dtype_bytes,
                trains=True,
            )
            worst = max(worst, kept + pipeline_buffer_bytes(spec, lay.t, lay.p, shape, w.dtype_bytes))
    return worst


def pool_footprint(
    w: Workload, run_layout: RunLayout, device: DeviceClass, pool: PoolLayout
) -> tuple[int, float | None]:
    """(peak bytes per rank, KV bytes left per device for generation: None where the pool does
    not generate, < 0 where not one sequence fits); the worst pipeline stage of each."""
    usable = device.memory_gb * 1e9 * USABLE
    statics = [_static_bytes(pool, w, j) for j in range(pool.layout.p)]
    train_peak = max(statics) + _activation_bytes(pool, w)
    if pool.name == ROLLOUT:
        t_g, p_g = pool.layout.t, 1
    elif "actor" in pool.roles and run_layout.separate is None:
        t_g, p_g = run_layout.t_g, run_layout.p_g
    else:
        return int(train_peak), None
    held = [st + generation_extra_bytes(w, run_layout, pool, j) for j, st in enumerate(statics)]
    budget = usable - max(held)
    one_seq = kv_bytes_per_seq(w.actor, t_g, p_g, w)
    replicas = pool.size // (t_g * p_g)
    seqs = math.ceil(w.samples * w.generations / replicas)
    gen_peak = max(h + min(max(usable - h, 0.0), seqs * one_seq) for h in held)
    return int(max(train_peak, gen_peak)), (budget if budget >= one_seq else -1.0)


def pool_footprints(
    w: Workload, run_layout: RunLayout, device: DeviceClass
) -> tuple[dict[str, int], dict[str, float]]:
    """({pool: peak bytes per rank}, {generating pool: KV bytes left per device, < 0: none})."""
    memory: dict[str, int] = {}
    kv_budget: dict[str, float] = {}
    for pool in run_layout.pools:
        memory[pool.name], budget = pool_footprint(w, run_layout, device, pool)
        if budget is not None:
            kv_budget[pool.name] = budget
    return memory, kv_budget
