"""What one RL step does (the workload) and where each role runs (the run layout): the step
simulator's two inputs, independent of any recipe (`rl3d.planning.from_config` builds both
from one).

Roles are rl3d's role-table names: actor (which also generates), critic and cost_critic (value
models), reference, reward_model and cost_model (learned scorers). A separate generation pool
is a pool named `rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout

ROLLOUT = "rollout"
TRAINED = ("actor", "critic", "cost_critic")
# which of the workload's model shapes a role runs
ROLE_MODEL = {
    "actor": "actor",
    "reference": "actor",
    "critic": "critic",
    "cost_critic": "critic",
    "reward_model": "reward",
    "cost_model": "reward",
}


@dataclass(frozen=True, kw_only=True)
class Workload:
    actor: ModelSpec
    critic: ModelSpec | None = None  # the value models' shape (None: the actor's)
    reward: ModelSpec | None = None  # the learned scorers' shape (None: the actor's)
    roles: tuple[str, ...] = ("actor",)
    prompts: int = 1024  # per step
    samples_per_prompt: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    generations: float = 1.0  # rollouts generated per training sample (ReMax's greedy baseline: 2)
    recompute_old_logp: bool = True  # a forward of the actor before its update
    ppo_epochs: int = 1
    mini_batch_size: int = 256  # samples per optimizer step
    micro_batch_size: int = 1  # samples per forward/backward on one data-parallel rank
    dtype_bytes: int = 2
    distributed_optimizer: bool = False
    flash_attention: bool = False  # fused attention keeps no s x s scores (packing on CUDA in rl3d)

    def __post_init__(self) -> None:
        unknown = [r for r in self.roles if r not in ROLE_MODEL]
        if unknown or "actor" not in self.roles:
            raise ValueError(f"workload roles {self.roles}: need 'actor'; known: {', '.join(ROLE_MODEL)}")

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens(self) -> int:
        """Prompt and response tokens of a step's batch (the paper's throughput numerator)."""
        return self.samples * self.seq_len

    def spec(self, role: str) -> ModelSpec:
        return getattr(self, ROLE_MODEL[role]) or self.actor


@dataclass(frozen=True)
class PoolLayout:
    name: str
    layout: ParallelLayout
    roles: tuple[str, ...]
    # trained roles of this pool that run with megatron's sequence parallelism (t > 1) and with
    # full activation recompute (each layer's forward rerun in the backward)
    sequence_parallel: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return self.layout.world_size


@dataclass(frozen=True, kw_only=True)
class RunLayout:
    """Where each role of a run sits: the resource pools, each with its parallel layout, and the
    generation layout on the actor's pool. (Whether generation is colocated is the recipe's
    `rollout.placement`; here a pool named `rollout` is a separate one.)"""

    pools: tuple[PoolLayout, ...]  # the first hosts the actor
    t_g: int = 1  # generation layout on the actor's pool (colocated generation)
    p_g: int = 1
    max_staleness: int = 0  # > 0: a separate rollout pool generates while the trainer updates

    def __post_init__(self) -> None:
        if not self.pools or "actor" not in self.pools[0].roles:
            raise ValueError("a run layout's first pool hosts the actor")

    @property
    def world(self) -> int:
        return sum(p.size for p in self.pools)

    @property
    def separate(self) -> PoolLayout | None:
        return next((p for p in self.pools if p.name == ROLLOUT), None)

    def pool_of(self, role: str) -> PoolLayout:
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise ValueError(f"no pool hosts role {role!r}")

    def describe(self) -> str:
        parts = []
        for p in self.pools:
            lay = p.layout
            what = "+".join(sorted(p.roles, key=lambda r: (r != "actor", r)))  # one spelling per pool
            ep = f" ep{lay.ep}" if lay.ep > 1 else ""
            flags = _flag("sp", p, p.sequence_parallel) + _flag("rc", p, p.recompute)
            parts.append(f"{what}[{p.size}: p{lay.p} t{lay.t} d{lay.d}{ep}{flags}]")
        gen = "" if self.separate else f" gen t_g{self.t_g} p_g{self.p_g}"
        return " ".join(parts) + gen


def _flag(name: str, pool: PoolLayout, roles: tuple[str, ...]) -> str:
    """ " sp" when every trained role of the pool has it, " sp(critic)" when some do."""
    if not roles:
        return ""
    trained = [r for r in pool.roles if r in TRAINED]
    return f" {name}" if set(roles) >= set(trained) else f" {name}({'+'.join(sorted(roles))})"
