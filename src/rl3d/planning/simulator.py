"""The step simulator: each stage of an RL step timed on a device class from FLOPs and bytes.

Stages, named as rl3d's timers name them (`time/<stage>`), run one after another as rl3d's
loop runs them (with `max_staleness > 0` a separate rollout pool generates while the trainer
works, so the step is the longer of the two):
- `prefill`, `decode`: generation on the actor's pool in its generation layout (t_g, p_g) or
  on the rollout pool. Prefill is compute-bound: 2N + 2Lhs FLOPs per token (s the causal
  average context) at `prefill_mfu`. Decode is memory-bound: every step reads the replica's
  weights and its KV cache once at `decode_hbm_eff` of HBM (or is compute-bound if its batch
  is large enough), passes its p_g stages one after another, does two tensor-parallel
  all-reduces per layer and pays `step_overhead_s`. When the KV cache of all sequences does
  not fit next to the resident state, decode runs in waves (`rl3d.planning.footprint`).
- `old_logp`, `ref_logp`, `values`, `reward_model`, `cost_model`: forwards (1x FLOPs);
  `update_actor`, `update_critic`: forward + backward (3x) per PPO epoch, plus per optimizer
  step the data-parallel all-reduce of fp32 gradients and a fused Adam over the rank's
  parameters (30 bytes per parameter through HBM; `rl3d.costs.optimizer`). Megatron's two
  tensor-parallel all-reduces per layer and direction are charged on the TP group's link, the
  pipeline bubble as (p - 1) / m of the pipelined time (m micro-batches per rank, 1F1B). With
  sequence parallelism (`PoolLayout.sequence_parallel`) megatron replaces each all-reduce by
  a reduce-scatter and an all-gather of the same bytes: a ring all-reduce is exactly those two,
  so the time is the same (the norms' work split over t is not counted). With full recompute
  (`PoolLayout.recompute`) the backward reruns each layer's forward: 4x a forward's FLOPs
  and its two all-reduces per layer (the fixed costs stay a training pass's: zero on the GPU
  classes, calibrated on a CPU without recompute).
- `reshard`: the colocated transition, rl3d's hybridflow mechanism on this device's cluster
  (`rl3d.costs.mechanisms`, the same model as `rl3d bench --modeled`); with a rollout pool the
  weight sync: every rollout rank receives its t_g-shard of the weights, over the rollout
  nodes' links (or NVLink when the whole job shares one node).
Every worker call, micro-batch, layer, optimizer step and decode step also pays the device's
fixed costs (`DeviceClass.fixed`: 0 on the GPU classes, calibrated on a CPU; a value model's
micro-batches and layers its own), and so does the
rule reward (`score`, per sample; free on the GPU classes, where it is small next to a step of
seconds), and so does the controller's work around a step's rollout (`control`: per step and per
sample), and so does a separate rollout pool's hand-over of its rows to the trainer (`handover`:
per step and per second the trainer waits for them); a stage whose ranks waited through the
stage before for another pool runs `wake_share` slower. Nothing here overlaps compute with
communication.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from rl3d.costs.mechanisms import MECHANISMS, mechanism_cost
from rl3d.costs.optimizer import adam_seconds
from rl3d.hybrid_engine.params import SegmentTable
from rl3d.hybrid_engine.plan import PlanContext, plan_transition
from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout
from rl3d.planning.devices import DeviceClass
from rl3d.planning.footprint import decode_waves, pool_footprints
from rl3d.planning.workload import PoolLayout, RunLayout, Workload

GRAD_BYTES = 4  # fp32 gradients (the paper's setup: BF16 parameters, FP32 gradients and optimizer)
SYNC_BUCKET_BYTES = 64 * 2**20  # rollout.async.bucket_mb's default: one call per bucket
VALUE_MODELS = ("critic", "cost_critic")  # their calls and passes pay the critic's fixed costs


@dataclass(frozen=True)
class StepEstimate:
    stages: dict[str, float]
    step_seconds: float
    fits: bool
    memory_bytes: dict[str, int] = field(default_factory=dict)  # peak per rank, per pool
    tokens: int = 0

    @property
    def bottleneck(self) -> str:
        return max(self.stages, key=self.stages.__getitem__) if self.stages else ""

    @property
    def throughput(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "step_seconds": self.step_seconds,
            "stages": self.stages,
            "bottleneck": self.bottleneck,
            "fits": self.fits,
            "memory_gb": {k: v / 1e9 for k, v in self.memory_bytes.items()},
            "throughput_tokens_per_s": self.throughput,
        }


def nodes_of(size: int, device: DeviceClass) -> int:
    return max(1, math.ceil(size / device.gpus_per_node))


def ring_allreduce_seconds(nbytes: float, group: int, spread: int, device: DeviceClass) -> float:
    """One ring all-reduce of `nbytes` over `group` devices whose ring spans `spread` devices
    (consecutive ranks: a TP group of 8 sits in one node, a DP group strides over nodes)."""
    if group <= 1:
        return 0.0
    nodes = nodes_of(spread, device)
    gbps = device.link_gbps(group, nodes)
    latency = 2 * device.nccl.ring_seconds(group, min(nodes, group))
    return latency + 2 * (group - 1) / group * nbytes / (gbps * 1e9)


def forward_flops(spec: ModelSpec, tokens: float, context: float) -> float:
    """2N per token for the matmuls, plus causal attention's QK^T and AV over `context`."""
    return tokens * (2 * spec.num_params() + 4 * spec.num_layers * spec.hidden_size * context)


def pass_seconds(
    spec: ModelSpec,
    layout: ParallelLayout,
    device: DeviceClass,
    w: Workload,
    *,
    samples: float,
    backward: bool,
    critic: bool = False,
    recompute: bool = False,
) -> float:
    """A forward (or forward + backward) of `samples` full sequences on `layout`; `critic`: of
    a value model (its own micro-batch and layer fixed costs); `recompute`: the backward reruns
    the forward."""
    recompute = recompute and backward
    passes = 3 + recompute if backward else 1
    tokens = samples * w.seq_len
    compute = (
        passes
        * forward_flops(spec, tokens, w.seq_len / 2)
        / (layout.world_size * device.flops * device.train_mfu)
    )
    per_rank = samples / layout.d
    micro = max(1.0, per_rank / w.micro_batch_size)
    bytes_per_micro = w.micro_batch_size * w.seq_len * spec.hidden_size * w.dtype_bytes
    calls = micro * 2 * (1 + backward + recompute) * spec.num_layers / layout.p
    tp = calls * ring_allreduce_seconds(bytes_per_micro, layout.t, layout.t, device)
    bubble = 1 + (layout.p - 1) / micro
    fixed, layers = device.fixed, spec.num_layers / layout.p
    split = layout.t > 1
    if backward:
        own = (
            fixed.critic_train_micro_s
            + layers * fixed.critic_train_layer_s
            + split * fixed.critic_train_tp_micro_s
            if critic
            else fixed.train_micro_s + layers * fixed.train_layer_s + split * fixed.train_tp_micro_s
        )
    else:
        own = (
            fixed.critic_micro_s + layers * fixed.critic_layer_s + split * fixed.critic_tp_micro_s
            if critic
            else fixed.micro_s + layers * fixed.layer_s + split * fixed.tp_micro_s
        )
    overhead = micro * own
    return (compute + tp + overhead) * bubble


def update_seconds(
    role: str, layout: ParallelLayout, device: DeviceClass, w: Workload, *, recompute: bool = False
) -> float:
    spec, critic = w.spec(role), role in VALUE_MODELS
    passes = w.ppo_epochs * pass_seconds(
        spec, layout, device, w, samples=w.samples, backward=True, critic=critic, recompute=recompute
    )
    steps = w.ppo_epochs * max(1, w.samples // w.mini_batch_size)
    shard = spec.num_params() / (layout.t * layout.p)
    grads = ring_allreduce_seconds(shard * GRAD_BYTES, layout.d, layout.world_size, device)
    adam = adam_seconds(shard / (layout.d if w.distributed_optimizer else 1), device.hbm_gbps)
    fixed = device.fixed
    if critic:
        call = fixed.critic_train_call_s + spec.num_layers / layout.p * fixed.critic_train_call_layer_s
        optim = fixed.critic_optim_step_s
    else:
        call = fixed.train_call_s + spec.num_layers / layout.p * fixed.train_call_layer_s
        optim = fixed.optim_step_s
    optim += (layout.t > 1) * fixed.train_tp_step_s
    return call + passes + steps * (grads + adam + optim)


def generate_seconds(
    spec: ModelSpec,
    world: int,
    t_g: int,
    p_g: int,
    device: DeviceClass,
    w: Workload,
    kv_budget: float,
    *,
    gathered: bool = True,
) -> tuple[float, float]:
    """(prefill, decode) seconds of a step's rollouts on `world` devices in (t_g, p_g);
    `gathered`: each replica's rows go to the controllers by a gather (colocated generation; a
    separate pool hands them over through the store, `handover` in `simulate`)."""
    replicas = world // (t_g * p_g)
    seqs = math.ceil(w.samples * w.generations / replicas)
    h, layers = spec.hidden_size, spec.num_layers
    act = h * w.dtype_bytes
    prefill = forward_flops(spec, seqs * w.prompt_len, w.prompt_len / 2) / (
        t_g * device.flops * device.prefill_mfu
    )
    prefill += 2 * layers * ring_allreduce_seconds(seqs * w.prompt_len * act, t_g, t_g, device)
    waves, per_wave = decode_waves(spec, seqs, t_g, p_g, w, kv_budget)
    kv_per_token = 2 * max(spec.num_query_groups // t_g, 1) * spec.head_dim * w.dtype_bytes * layers / p_g
    context = w.prompt_len + w.response_len / 2
    weights = spec.num_params() * w.dtype_bytes / (t_g * p_g)
    memory = (weights + per_wave * context * kv_per_token) / (device.hbm_gbps * 1e9 * device.decode_hbm_eff)
    compute = forward_flops(spec, per_wave, context) / (t_g * p_g * device.flops * device.prefill_mfu)
    allreduce = 2 * layers * ring_allreduce_seconds(per_wave * act, t_g, t_g, device)
    step = (
        p_g * max(memory, compute) + allreduce + device.step_overhead_s + layers * device.fixed.decode_layer_s
    )
    prefill += device.fixed.gen_call_s + layers * device.fixed.decode_layer_s  # its layers' forward
    prefill += gathered * device.fixed.gen_gather_s
    return prefill, waves * w.response_len * step


@functools.lru_cache(maxsize=256)
def transition_seconds(
    spec: ModelSpec, layout: ParallelLayout, t_g: int, p_g: int, device: DeviceClass, dtype: str
) -> float:
    plan = plan_transition(spec, layout, t_g, p_g, dtype=dtype, strategies=("hybridflow",))
    ctx = PlanContext(spec, plan.gen, plan.dtype_bytes, plan.params, SegmentTable(plan.params, layout.t))
    cluster = device.cluster()
    return mechanism_cost(MECHANISMS["hybridflow"](ctx, plan, cluster), cluster)["seconds"]


def weight_sync_seconds(
    spec: ModelSpec, actor: PoolLayout, rollout: PoolLayout, device: DeviceClass, w: Workload
) -> float:
    """Every rollout rank receives its t_g-shard; a rollout node's link carries its ranks'."""
    model = spec.num_params() * w.dtype_bytes
    shard = model / rollout.layout.t
    if actor.size + rollout.size <= device.gpus_per_node:
        wire = shard / (device.nvlink_gbps * 1e9)
    else:
        per_node = min(rollout.size, device.gpus_per_node)
        senders = nodes_of(actor.size, device)
        wire = max(per_node * shard, rollout.layout.d * model / senders) / (device.node_net_gbps * 1e9)
    calls = math.ceil(shard / SYNC_BUCKET_BYTES)
    return wire + calls * device.nccl.ring_seconds(2, 2)


DTYPE_NAMES = {2: "bfloat16", 4: "float32"}


def pool_stages(
    w: Workload,
    run_layout: RunLayout,
    device: DeviceClass,
    pool: PoolLayout,
    kv_budget: float,
    *,
    transition: bool = True,
) -> dict[str, float]:
    """The seconds of the stages that run on `pool` (generation on the pool that generates, the
    weight sync charged to the rollout pool); `transition=False` leaves the colocated reshard
    out (a search's cheap bound: planning a transition is the costly part)."""
    stages: dict[str, float] = {}
    rollout = run_layout.separate
    if pool is rollout:
        stages["prefill"], stages["decode"] = generate_seconds(
            w.actor, pool.size, pool.layout.t, 1, device, w, kv_budget, gathered=False
        )
        stages["reshard"] = weight_sync_seconds(w.actor, run_layout.pool_of("actor"), pool, device, w)
        return stages
    lay, hosted = pool.layout, [r for r in pool.roles if r in w.roles]
    if "actor" in hosted and rollout is None:
        stages["prefill"], stages["decode"] = generate_seconds(
            w.actor, pool.size, run_layout.t_g, run_layout.p_g, device, w, kv_budget
        )

    fixed = device.fixed

    def forward(*roles: str) -> float:
        seconds = 0.0
        for r in roles:
            critic, layers = r in VALUE_MODELS, w.spec(r).num_layers / lay.p
            call = (
                fixed.critic_call_s + layers * fixed.critic_call_layer_s
                if critic
                else fixed.call_s + layers * fixed.call_layer_s
            )
            seconds += call + pass_seconds(
                w.spec(r), lay, device, w, samples=w.samples, backward=False, critic=critic
            )
        return seconds

    if "actor" in hosted and w.recompute_old_logp:
        stages["old_logp"] = forward("actor")
    for stage, roles in (
        ("reward_model", ("reward_model",)),
        ("cost_model", ("cost_model",)),
        ("ref_logp", ("reference",)),
    ):
        if set(roles) & set(hosted):
            stages[stage] = forward(*roles)
    critics = [r for r in VALUE_MODELS if r in hosted]
    if critics:
        stages["values"] = forward(*critics)
        stages["update_critic"] = sum(
            update_seconds(r, lay, device, w, recompute=r in pool.recompute) for r in critics
        )
    if "actor" in hosted:
        stages["update_actor"] = update_seconds("actor", lay, device, w, recompute="actor" in pool.recompute)
        if rollout is None and transition:
            dtype = DTYPE_NAMES.get(w.dtype_bytes, "bfloat16")
            stages["reshard"] = transition_seconds(
                w.actor, lay, run_layout.t_g, run_layout.p_g, device, dtype
            )
    return stages


STAGE_ORDER = (
    "prefill", "decode", "score", "control", "handover", "reward_model", "cost_model", "old_logp", "values",
    "ref_logp", "update_critic", "update_actor", "reshard",
)  # fmt: skip


def simulate(w: Workload, run_layout: RunLayout, device: DeviceClass) -> StepEstimate:
    """Every stage's seconds, the step's, and whether each pool's peak fits the device."""
    memory, kv_budget = pool_footprints(w, run_layout, device)
    stages: dict[str, float] = dict.fromkeys(STAGE_ORDER, 0.0)
    for pool in run_layout.pools:
        for stage, seconds in pool_stages(w, run_layout, device, pool, kv_budget.get(pool.name, 0.0)).items():
            stages[stage] += seconds
    # the rule reward: every controller scores every rollout (rl3d times it inside `generate`),
    # and the controller's own work around the rollout (also inside `generate`)
    rollouts, fixed = w.samples * w.generations, device.fixed
    stages["score"] = rollouts * fixed.score_sample_s
    stages["control"] = fixed.control_step_s + rollouts * fixed.control_sample_s
    generation = stages["prefill"] + stages["decode"]
    if run_layout.separate is not None:  # the trainer polls for the pool's rows while it waits
        waited = generation
        if run_layout.max_staleness > 0:  # the pool generated while the trainer worked
            waited = max(0.0, 2 * generation - sum(stages.values()))
        stages["handover"] = fixed.handover_s + waited * fixed.handover_wait_share
    if fixed.wake_share:
        for stage in woken_stages(w, run_layout, stages):
            stages[stage] *= 1 + fixed.wake_share
    stages = {k: v for k, v in stages.items() if v > 0 or k in ("prefill", "decode", "update_actor")}
    total = sum(stages.values())
    if run_layout.separate is not None and run_layout.max_staleness > 0:
        total = max(generation, total - generation)
    return StepEstimate(stages, total, fits_device(memory, kv_budget, device), memory, w.tokens)


# the trainer's stages after generation in rl3d's order, each with the roles whose pool runs it
POOL_ORDER = (
    ("old_logp", ("actor",)), ("values", VALUE_MODELS), ("ref_logp", ("reference",)),
    ("update_critic", VALUE_MODELS), ("update_actor", ("actor",)), ("reshard", ("actor",)),
)  # fmt: skip


def woken_stages(w: Workload, run_layout: RunLayout, stages: dict[str, float]) -> list[str]:
    """The stages whose pool did not run the stage before: its ranks waited for another pool
    (a separate pool's generation, when the trainer waits for it, counts as another pool's)."""
    previous = run_layout.pools[0].name  # the step before ended with the actor's reshard
    if run_layout.separate is not None and run_layout.max_staleness == 0:
        previous = run_layout.separate.name
    woken = []
    for stage, roles in POOL_ORDER:
        role = next((r for r in roles if r in w.roles), None)
        if role is None or stages.get(stage, 0.0) <= 0:
            continue
        pool = run_layout.pool_of(role).name
        if pool != previous:
            woken.append(stage)
        previous = pool
    return woken


def fits_device(memory: dict[str, int], kv_budget: dict[str, float], device: DeviceClass) -> bool:
    usable = device.memory_bytes
    return all(v <= usable for v in memory.values()) and all(b >= 0 for b in kv_budget.values())
