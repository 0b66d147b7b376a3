"""Process groups for the 3D-HybridEngine, built once from the layouts and passed around.

`torch.distributed.new_group` is collective over the whole world (every rank creates every
group, in the same order), so all groups any strategy needs are made here, once. Nothing
reads a megatron global: the rank lists come from `GenerationLayout`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from rl3d.parallel.layout import GenerationLayout


@dataclass(frozen=True)
class Group:
    """A process group with its ranks and a name for error messages."""

    name: str
    ranks: tuple[int, ...]
    handle: object  # torch ProcessGroup; None when this rank is not a member

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


@dataclass(frozen=True)
class HybridGroups:
    """The groups of this rank. `extra` holds the openrlhf rollout ranks (>= train world)."""

    gen: GenerationLayout
    rank: int
    timeout_s: float
    micro_dp: Group  # d_g ranks that all-gather one generation shard
    pp_micro: Group  # members of micro_dp with this rank's training TP rank (norms travel here)
    gen_tp: Group
    gen_pp: Group
    gen_dp: Group  # every rank holding the same generation shard (d_g * d of them)
    model_parallel: Group  # the t*p ranks of this rank's training replica
    pipeline: Group  # the p ranks of this rank's (dp, tp) across stages
    world: Group  # the training world (t*p*d ranks)
    rollout_broadcast: Group | None  # openrlhf: trainer rank 0 + the rollout ranks
    # gen_tp's gloo twin: control messages that wait on SGLang (its launch, each generate) stay
    # off NCCL, whose waits time out and spin on the GPUs SGLang runs on
    gen_tp_control: Group | None = None
    # expert parallelism (ep > 1): the micro-DP groups of one EP group, joined; experts travel here
    expert_micro_dp: Group | None = None


def _pp_micro_groups(gen: GenerationLayout) -> list[list[int]]:
    groups = []
    for group in gen.micro_dp_groups():
        by_tp: dict[int, list[int]] = {}
        for r in group:
            by_tp.setdefault(gen.train.coords(r).tp, []).append(r)
        groups += list(by_tp.values())
    return groups


def build_hybrid_groups(
    gen: GenerationLayout, *, timeout_s: float, rollout_ranks: int = 0, control_timeout_s: float | None = None
) -> HybridGroups:
    """Create every group (collective over the world). `rollout_ranks` > 0 adds openrlhf's
    separate rollout GPUs, which are world ranks train_world .. train_world + rollout_ranks - 1.
    `control_timeout_s` adds `gen_tp_control`, a gloo twin of each generation-TP group that
    waits that long."""
    rank = dist.get_rank()
    train_world = gen.world_size
    expected = train_world + rollout_ranks
    if dist.get_world_size() != expected:
        raise ValueError(
            f"world size {dist.get_world_size()} != training world {train_world} "
            f"+ rollout ranks {rollout_ranks}"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    mine: dict[str, Group] = {}

    def make(name: str, rank_lists: list[list[int]], **options) -> None:
        for ranks in rank_lists:
            handle = dist.new_group(ranks=ranks, **({"timeout": timeout} | options))
            if rank in ranks:
                mine[name] = Group(name, tuple(ranks), handle)

    make("micro_dp", gen.micro_dp_groups())
    make("pp_micro", _pp_micro_groups(gen))
    make("gen_tp", gen.gen_tp_groups())
    make("gen_pp", gen.gen_pp_groups())
    make("gen_dp", gen.gen_dp_groups())
    make("model_parallel", gen.train.model_parallel_groups())
    make("pipeline", gen.train.pp_groups())
    make("world", [list(range(train_world))])
    if gen.train.ep > 1:
        make("expert_micro_dp", gen.expert_micro_dp_groups())
    if rollout_ranks:
        make("rollout_broadcast", [[0, *range(train_world, expected)]])
    if control_timeout_s is not None:
        control = datetime.timedelta(seconds=control_timeout_s)
        make("gen_tp_control", gen.gen_tp_groups(), backend="gloo", timeout=control)
    return HybridGroups(
        gen=gen,
        rank=rank,
        timeout_s=timeout_s,
        micro_dp=mine.get("micro_dp"),
        pp_micro=mine.get("pp_micro"),
        gen_tp=mine.get("gen_tp"),
        gen_pp=mine.get("gen_pp"),
        gen_dp=mine.get("gen_dp"),
        model_parallel=mine.get("model_parallel"),
        pipeline=mine.get("pipeline"),
        world=mine.get("world"),
        rollout_broadcast=mine.get("rollout_broadcast"),
        gen_tp_control=mine.get("gen_tp_control"),
        expert_micro_dp=mine.get("expert_micro_dp"),
    )
