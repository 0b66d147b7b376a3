"""The one module that calls megatron-core's `parallel_state` globals.

`init_megatron(layout, seed=...)` builds megatron's process groups for a `ParallelLayout`,
checks they are the layout's groups, seeds the RNGs and returns a frozen `MegatronGroups`.
Everything else in rl3d takes that object (and its `pg_collection`, which megatron-core's
GPTModel, DDP, optimizer, schedules and `finalize_model_grads` accept) instead of reading
megatron's globals. torch.distributed itself is initialised by the caller (torchrun or a test's
spawn helper); on CPU the backend is gloo and the CPU shim is activated here.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import rl3d.models.cpu_shim as cpu_shim
from rl3d.parallel.layout import ParallelLayout, RankCoords
from rl3d.utils.device import collective_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronGroups:
    """This rank's place in the training grid and its megatron process groups."""

    layout: ParallelLayout
    rank: int
    coords: RankCoords
    tp_group: Any
    pp_group: Any
    dp_group: Any  # the d ranks that get different samples (same pp, cp and tp)
    mp_group: Any  # the t*p ranks of this rank's replica
    embedding_group: Any  # first and last PP stage (tied embeddings)
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    dp_group_gloo: Any = None  # the distributed optimizer's gloo twin of dp_group
    ep_group: Any = None  # the layout.ep ranks splitting the experts (a MoE model's all-to-all)
    expert_dp_group: Any = None  # the ranks holding the same expert shard
    expert_tp_group: Any = None  # the layout.expert_t ranks splitting each of their experts
    cp_group: Any = None  # the layout.cp ranks splitting each sequence (ring attention)
    dp_cp_group: Any = None  # the cp*d ranks holding this rank's weight shard (gradients reduced)
    # where this rank computes: the world's backend says (NCCL: this rank's bound GPU)
    device: torch.device = torch.device("cpu")

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def holds_outputs(self) -> bool:
        """This rank returns its replica's outputs: the last stage's TP and CP rank 0 (its
        peers in the TP and CP groups hold the same)."""
        return self.coords.tp == 0 and self.coords.cp == 0 and self.is_last_stage

    @property
    def ep_rank(self) -> int:
        return self.coords.ep

    @property
    def etp_rank(self) -> int:
        return self.coords.etp

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.p - 1


def _ranks(group: Any) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _own_group(groups: list[list[int]], rank: int) -> list[int]:
    return next(sorted(g) for g in groups if rank in g)


def _world_timeout_s(device) -> float:
    """The world's collective timeout (`launch.timeout_s`), for megatron's groups too: with
    megatron's default (30 min) a node lost mid-step hangs the job that long."""
    try:
        return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # a backend without options: megatron's default
        return 30 * 60.0


def init_megatron(layout: ParallelLayout, *, seed: int = 1234) -> MegatronGroups:
    """Build megatron's process groups for `layout` on an initialised torch.distributed world."""
    if not dist.is_initialized():
        raise RuntimeError("init_megatron needs torch.distributed initialised by the caller")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, world has {world}")
    device = collective_device()  # the configured device chose the world's backend
    cpu_shim.activate(device.type)

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron is already initialised in this process; call destroy_megatron()")
    # Megatron's default order makes tp fastest, then cp, then dp, then pp: the layout's rank formula.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.t,
        pipeline_model_parallel_size=layout.p,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_t,
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=True,
        distributed_timeout_minutes=_world_timeout_s(device) / 60,
    )
    rank = dist.get_rank()
    coords = layout.coords(rank)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    groups = MegatronGroups(
        layout=layout,
        rank=rank,
        coords=coords,
        tp_group=pgs.tp,
        pp_group=pgs.pp,
        dp_group=pgs.dp,
        mp_group=pgs.mp,
        embedding_group=pgs.embd,
        pg_collection=pgs,
        dp_group_gloo=parallel_state.get_data_parallel_group_gloo(with_context_parallel=True),
        ep_group=pgs.ep,
        expert_dp_group=pgs.expt_dp,
        expert_tp_group=pgs.expt_tp,
        cp_group=pgs.cp,
        dp_cp_group=pgs.dp_cp,
        device=device,
    )
    _check_matches_layout(groups)

    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    logger.info("megatron initialised: layout %s, rank %d at %s", layout, rank, coords)
    return groups


def _check_matches_layout(groups: MegatronGroups) -> None:
    layout, rank = groups.layout, groups.rank
    expected = {
        "tp": _own_group(layout.tp_groups(), rank),
        "pp": _own_group(layout.pp_groups(), rank),
        "dp": _own_group(layout.dp_groups(), rank),
        "cp": _own_group(layout.cp_groups(), rank),
        "dp_cp": _own_group(layout.dp_cp_groups(), rank),
        "mp": _own_group(layout.model_parallel_groups(), rank),
        "ep": _own_group(layout.ep_groups(), rank),
        "expert_dp": _own_group(layout.expert_dp_groups(), rank),
        "expert_tp": _own_group(layout.expert_tp_groups(), rank),
    }
    actual = {
        "tp": _ranks(groups.tp_group),
        "pp": _ranks(groups.pp_group),
        "dp": _ranks(groups.dp_group),
        "cp": _ranks(groups.cp_group),
        "dp_cp": _ranks(groups.dp_cp_group),
        "mp": _ranks(groups.mp_group),
        "ep": _ranks(groups.ep_group),
        "expert_dp": _ranks(groups.expert_dp_group),
        "expert_tp": _ranks(groups.expert_tp_group),
    }
    assert actual == expected, f"megatron's groups {actual} differ from layout {layout}: {expected}"


def destroy_megatron() -> None:
    """Drop megatron's global groups and RNG tracker (torch.distributed stays up)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.destroy_model_parallel()
    mrandom.initialize_rng_tracker(force_reset=True)
