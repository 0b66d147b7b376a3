"""Per-device memory of a placement, as the step simulator needs it: does each pool's peak
fit, and how much KV cache is left for generation (decode runs in waves when a step's
sequences do not fit at once).

Per rank of a pool, for each role it hosts (parameters sharded over t*p):
- a trained role: BF16 parameters (2 bytes), FP32 gradients (4) and Adam's FP32 master, m and
  v (12, over d with the distributed optimizer): the paper's training setup;
- a forward-only role (reference, reward and cost models): its BF16 parameters;
- activations of the largest trained role while it trains, counted as the memory plan counts
  them (`rl3d.planning.memory_activations`: no recompute; flash attention or megatron's local
  attention as `Workload.flash_attention` says);
- generation on the actor's pool: the generation shard beyond the training shard, then KV.
Everything stays resident (nothing offloaded during generation), and `USABLE` of the device's
memory is available (the rest: CUDA context, NCCL buffers, fragmentation; an assumption).
"""

from __future__ import annotations

import math

from rl3d.models.spec import ModelSpec
from rl3d.planning.devices import DeviceClass
from rl3d.planning.memory_activations import MicroBatchShape, activation_bytes
from rl3d.planning.workload import TRAINED, Placement, PoolPlacement, Workload

USABLE = 0.9
TRAIN_STATE_BYTES = 2 + 4  # parameters + gradients
ADAM_STATE_BYTES = 12


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


def _static_bytes(pool: PoolPlacement, w: Workload) -> float:
    lay = pool.layout
    total = 0.0
    for role in pool.roles:
        if role == "rollout" or role not in w.roles:
            continue
        shard = w.spec(role).num_params() / (lay.t * lay.p)
        if role in TRAINED:
            adam = ADAM_STATE_BYTES / (lay.d if w.distributed_optimizer else 1)
            total += shard * (TRAIN_STATE_BYTES + adam)
        else:
            total += shard * w.dtype_bytes
    return total


def _activation_bytes(pool: PoolPlacement, w: Workload) -> float:
    """The largest trained role's activations on its worst stage (the memory plan's count:
    `rl3d.planning.memory_activations`): the first holds min(p, m) micro-batches, the last the
    output layer."""
    lay = pool.layout
    micro = max(1, w.mini_batch_size // (lay.d * w.micro_batch_size))
    worst = 0
    for role in (r for r in pool.roles if r in TRAINED and r in w.roles):
        spec = w.spec(role)
        for in_flight, last in ((min(lay.p, micro), lay.p == 1), (1, True)):
            shape = MicroBatchShape(
                w.seq_len, w.micro_batch_size, w.response_len, w.flash_attention, False, in_flight
            )
            worst = max(
                worst,
                activation_bytes(
                    spec,
                    tp=lay.t,
                    layers=spec.num_layers // lay.p,
                    last_stage=last,
                    lm_head=role == "actor",
                    shape=shape,
                    dtype_bytes=w.dtype_bytes,
                    trains=True,
                ),  # fmt: skip
            )
    return worst


def pool_footprint(
    w: Workload, placement: Placement, device: DeviceClass, pool: PoolPlacement
) -> tuple[int, float | None]:
    """(peak bytes per rank, KV bytes left per device for generation: None where the pool does
    not generate, < 0 where not one sequence fits)."""
    usable = device.memory_gb * 1e9 * USABLE
    static = _static_bytes(pool, w)
    train_peak = static + _activation_bytes(pool, w)
    if pool.name == "rollout":
        t_g, p_g = pool.layout.t, 1
        extra = w.actor.num_params() * w.dtype_bytes / t_g
    elif "actor" in pool.roles and placement.separate is None:
        t_g, p_g = placement.t_g, placement.p_g
        lay = pool.layout
        extra = w.actor.num_params() * w.dtype_bytes * (1 / (t_g * p_g) - 1 / (lay.t * lay.p))
    else:
        return int(train_peak), None
    budget = usable - static - extra
    one_seq = kv_bytes_per_seq(w.actor, t_g, p_g, w)
    replicas = pool.size // (t_g * p_g)
    seqs = math.ceil(w.samples * w.generations / replicas)
    gen_peak = static + extra + min(max(budget, 0.0), seqs * one_seq)
    return int(max(train_peak, gen_peak)), (budget if budget >= one_seq else -1.0)


def pool_footprints(
    w: Workload, placement: Placement, device: DeviceClass
) -> tuple[dict[str, int], dict[str, float]]:
    """({pool: peak bytes per rank}, {generating pool: KV bytes left per device, < 0: none})."""
    memory: dict[str, int] = {}
    kv_budget: dict[str, float] = {}
    for pool in placement.pools:
        memory[pool.name], budget = pool_footprint(w, placement, device, pool)
        if budget is not None:
            kv_budget[pool.name] = budget
    return memory, kv_budget
