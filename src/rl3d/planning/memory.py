"""A per-rank GPU memory plan of a recipe, from shapes alone (no device, no weights).

    plan = plan_memory(cfg, device_bytes=80 << 30)
    plan.fits            # every rank's peak <= device_bytes (None without a device size)
    plan.worst()         # the rank with the largest peak
    plan.to_json()       # {"device_bytes", "ranks": [{"rank", "node", "pool", "phases",
                         #   "phase_peak_bytes", "peak_bytes", "peak_phase"}], "fits", "not_planned"}

For every rank of every pool (`rl3d.config.pools.role_pools`), bytes by phase:
- train: every role the rank hosts keeps its parameters, gradient buffer, master copy and
  Adam states (`rl3d.planning.memory_train`); the roles run one at a time, so the phase's peak
  is their static bytes plus the largest one's activations and buffers
  (`rl3d.planning.memory_activations`), each role's micro-batch as its features shape it
  (`rl3d.planning.memory_roles.role_footprint`); with delta weight updates to a separate
  rollout pool a sending rank also keeps the buckets it last sent (`weight_sync`);
- reshard: the static bytes, the generation weights the 3D-HybridEngine builds, the engine's
  own copy and the transfer buckets (`rl3d.planning.memory_generate`);
- generate: what the roles keep resident (less what `<role>.offload` moves to the host) plus
  the engine's weights, KV cache and workspace; SGLang's KV pool is min(its own sizing by
  `mem_fraction_static` at launch, `max_total_tokens`, the rank's whole share of the step's
  sequences) (`rl3d.planning.memory_generate.sglang_pool`).
An SGLang engine without `enable_memory_saver` keeps its weights and KV cache through training.
With a device size (a GPU plan) every phase also holds `device`: CUDA contexts, NCCL and a
fragmentation share (`rl3d.planning.memory_generate.DeviceBytes`).
Each phase's peak, the rank's largest, and whether it fits `device_bytes`; a rank also fails
to fit when SGLang's own sizing leaves its pool no full-length sequence (`RankPlan.problems`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl3d.config.async_rollout import ROLLOUT_POOL, is_separate
from rl3d.config.pools import Pool, role_pools, weight_sync_plan
from rl3d.config.roles import ACTOR
from rl3d.config.schema import RL3DConfig
from rl3d.models.spec import ModelSpec, spec_of
from rl3d.parallel import GenerationLayout
from rl3d.planning.memory_generate import (
    DeviceBytes,
    EngineBytes,
    GenShape,
    SyncBytes,
    device_beside,
    engine_bytes,
    sequence_kv_bytes,
    sglang_pool,
)
from rl3d.planning.memory_roles import (
    RoleModel,
    resident_in_generation,
    role_footprint,
    role_model,
    role_train_bytes,
)
from rl3d.planning.memory_train import RoleBytes
from rl3d.utils.dtypes import DTYPE_BYTES

PHASES = ("train", "reshard", "generate")
ENGINE = "engine"  # the rollout engine's entry in a phase
DEVICE = "device"  # what a GPU holds besides the planned tensors (a plan with a device size)
WEIGHT_SYNC = "weight_sync"  # a training rank's copy of what it last sent (delta weight updates)

Entry = RoleBytes | EngineBytes | DeviceBytes | SyncBytes


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    pool: str
    phases: dict[str, dict[str, Entry]]
    peaks: dict[str, int]  # phase -> peak bytes
    problems: tuple[str, ...] = ()  # why the rank cannot run beyond its peaks (SGLang's sizing)

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=lambda p: (self.peaks[p], -PHASES.index(p)))

    @property
    def peak_bytes(self) -> int:
        return self.peaks[self.peak_phase]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "pool": self.pool,
            "phases": {
                phase: {name: entry.to_json() for name, entry in entries.items()}
                for phase, entries in self.phases.items()
            },
            "phase_peak_bytes": dict(self.peaks),
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class MemoryPlan:
    device_bytes: int | None
    ranks: list[RankPlan]
    not_planned: tuple[str, ...] = field(default=())  # roles whose memory the plan does not know

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return all(r.peak_bytes <= self.device_bytes and not r.problems for r in self.ranks)

    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank))

    def to_json(self) -> dict[str, Any]:
        return {
            "device_bytes": self.device_bytes,
            "ranks": [r.to_json() for r in self.ranks],
            "fits": self.fits,
            "not_planned": list(self.not_planned),
        }


def _train_peak(entries: dict[str, Entry]) -> int:
    """Roles run one at a time: every static byte plus the largest dynamic part."""
    static = sum(e.static if isinstance(e, RoleBytes) else e.total for e in entries.values())
    dynamic = max((e.dynamic for e in entries.values() if isinstance(e, RoleBytes)), default=0)
    return static + dynamic


def _resharded_bytes(cfg: RL3DConfig, spec: ModelSpec, pool: Pool) -> list[int]:
    """Per actor-pool rank: generation-weight bytes the hybrid engine adds to the training shard."""
    # the schema's `hybrid_engine.strategy` may name a baseline (only the recipe check refuses one
    # for a run), so register them to plan whichever is named
    from rl3d.hybrid_engine import baselines as _baselines  # noqa: F401
    from rl3d.hybrid_engine.plan import plan_transition

    strategy = cfg.hybrid_engine.strategy
    plan = plan_transition(
        spec, pool.layout, cfg.rollout.t_g, cfg.rollout.p_g, dtype=cfg.model.dtype, strategies=(strategy,)
    )
    ctx = plan._ctx
    costs = {c.rank: c for c in plan.strategies[strategy].ranks}
    out = []
    for rank in range(pool.size):
        cost = costs[rank]
        held = ctx.nbytes(ctx.train_segs(rank))
        out.append(max(0, cost.peak_param_bytes + cost.redundant_bytes - held))
    return out


def _gen_shape(cfg: RL3DConfig, pool: Pool, rank: int) -> GenShape:
    if pool.name == ROLLOUT_POOL:
        return GenShape(
            tp=pool.layout.t, pp=1, pp_rank=0, dp_size=pool.layout.d, train_tp=cfg.actor.parallel.tp
        )
    gen = GenerationLayout.from_training(pool.layout, cfg.rollout.t_g, cfg.rollout.p_g)
    coords = gen.coords(rank)
    return GenShape(
        tp=gen.t_g, pp=gen.p_g, pp_rank=coords.pp_g, dp_size=gen.d_g * pool.layout.d, train_tp=pool.layout.t
    )


def _rank_plan(
    cfg: RL3DConfig,
    spec: ModelSpec,
    pool: Pool,
    rank: int,
    roles: list[RoleModel],
    resharded: list[int],
    device_bytes: int | None,
    transformer_engine: bool,
    kept: int = 0,
) -> RankPlan:
    world_rank = pool.offset + rank
    node = world_rank // max(cfg.launch.nproc_per_node, 1)
    pp_rank = pool.layout.coords(rank).pp
    prints = {
        r.name: role_footprint(cfg, spec, r, pool.layout, pp_rank, transformer_engine=transformer_engine)
        for r in roles
    }
    train: dict[str, Entry] = {
        r.name: role_train_bytes(cfg, spec, r, pool.layout, rank, prints[r.name]) for r in roles
    }
    if kept:
        train[WEIGHT_SYNC] = SyncBytes(previous=kept)
    phases: dict[str, dict[str, Entry]] = {"train": train}
    problems: list[str] = []
    sglang = cfg.rollout.engine == "sglang"
    generates = pool.name == ROLLOUT_POOL or ("actor" in pool.roles and not is_separate(cfg))
    gpu = device_bytes is not None
    processes = 1 + (1 if sglang and generates else 0)  # SGLang's scheduler is a process of its own
    if generates:
        colocated = pool.name != ROLLOUT_POOL
        shape = _gen_shape(cfg, pool, rank)
        at_reshard, at_generate = engine_bytes(
            cfg, spec, shape, resharded=resharded[rank] if colocated else 0, colocated=colocated
        )
        statics = {name: resident_in_generation(b, ()) for name, b in train.items()}
        phases["reshard"] = statics | {ENGINE: at_reshard}
        offloaded = {r.name: resident_in_generation(train[r.name], prints[r.name].offload) for r in roles}
        if sglang and gpu:
            beside = device_beside(cfg, processes=processes, allocated=0).total
            at_generate, problem = sglang_pool(
                cfg,
                spec,
                shape,
                at_generate,
                others=sum(b.total for b in offloaded.values()) + beside,
                at_launch=sum(b.total for b in statics.values()) + beside,
                device_bytes=device_bytes,
            )
            problems += [problem] if problem is not None else []
        phases["generate"] = offloaded | {ENGINE: at_generate}
        if sglang and not cfg.rollout.sglang.enable_memory_saver:
            train[ENGINE] = EngineBytes(weights=at_generate.weights, kv_cache=at_generate.kv_cache)
    peaks = {phase: _phase_peak(phase, entries) for phase, entries in phases.items()}
    if gpu:
        for phase, entries in phases.items():
            entries[DEVICE] = device_beside(cfg, processes=processes, allocated=peaks[phase])
        peaks = {phase: _phase_peak(phase, entries) for phase, entries in phases.items()}
    return RankPlan(world_rank, node, pool.name, phases, peaks, tuple(problems))


def _delta_kept_bytes(cfg: RL3DConfig, spec: ModelSpec, pool: Pool) -> list[int]:
    """Per rank of `pool`: what it keeps of its last weight sync to a separate rollout pool
    (`rollout.weight_update: delta`: the bytes the plan has it send), else 0."""
    if pool.name != ACTOR or not is_separate(cfg) or cfg.rollout.weight_update != "delta":
        return [0] * pool.size
    plan = weight_sync_plan(cfg, spec)
    return [plan.plan.ranks[rank].send_bytes for rank in range(pool.size)]


def _phase_peak(phase: str, entries: dict[str, Entry]) -> int:
    return _train_peak(entries) if phase == "train" else sum(e.total for e in entries.values())


def plan_memory(
    cfg: RL3DConfig, device_bytes: int | None = None, *, transformer_engine: bool = True
) -> MemoryPlan:
    """Every rank's bytes by phase for recipe `cfg` (see the module docstring).
    `transformer_engine`: whether a CUDA run has Transformer Engine (the gpu extra installs it);
    without it packing is refused as the builder refuses it (`NeedsTransformerEngine`)."""
    spec = spec_of(cfg.model)
    pools = role_pools(cfg)
    ranks: list[RankPlan] = []
    unknown: list[str] = []
    for pool in pools:
        roles = []
        for name in pool.roles:
            if name == "reference" and cfg.actor.lora is not None:
                continue  # no model: the LoRA actor's base is the reference
            model = role_model(cfg, name) if name != ROLLOUT_POOL else None
            if model is not None:
                roles.append(model)
            elif name != ROLLOUT_POOL:
                unknown.append(name)
        resharded = _resharded_bytes(cfg, spec, pool) if "actor" in pool.roles else []
        kept = _delta_kept_bytes(cfg, spec, pool)
        ranks += [
            _rank_plan(cfg, spec, pool, rank, roles, resharded, device_bytes, transformer_engine, kept[rank])
            for rank in range(pool.size)
        ]
    return MemoryPlan(device_bytes, ranks, tuple(unknown))


def sglang_kv_tokens(cfg: RL3DConfig, device_bytes: int) -> int | None:
    """SGLang's KV pool in tokens per rank on a device of `device_bytes`: the smallest pool the
    plan's generate phase leaves on any generating rank (None without an SGLang engine)."""
    if cfg.rollout.engine != "sglang":
        return None
    plan = plan_memory(cfg, device_bytes)
    spec = spec_of(cfg.model)
    pools = {p.name: p for p in role_pools(cfg)}
    dtype_bytes = DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype]
    slots = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    tokens = []
    for rank in plan.ranks:
        engine = rank.phases.get("generate", {}).get(ENGINE)
        if engine is None:
            continue
        pool = pools[rank.pool]
        per_token = (
            sequence_kv_bytes(cfg, spec, _gen_shape(cfg, pool, rank.rank - pool.offset), dtype_bytes) // slots
        )
        tokens.append(engine.kv_cache // per_token)
    return min(tokens, default=None)
