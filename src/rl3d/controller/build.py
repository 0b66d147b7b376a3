"""A run built once for any (config, backend): `build_run`.

A backend (`rl3d.launch.spmd_backend.SPMDRun` under torchrun, `rl3d.launch.ray_launch.RayRun`
for the Ray driver) starts the processes: the training pools' ranks with their role workers
and, with `rollout.placement: separate`, the rollout pool's ranks, the link to them and the
weight bridge. It hands back this process's part (`Started`). Everything else is built here:
data and tokenizer, the weight-sync plan, the placement, and the controller around the role
groups (`rl3d.controller.assemble`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rl3d.config import RL3DConfig
from rl3d.config.async_rollout import is_separate
from rl3d.config.pools import role_pools
from rl3d.controller.assemble import Backend, RunData, assemble_trainer, build_data


@dataclass
class Started:
    """This process's part of a run, as the backend started it.

    A rollout-pool rank (spmd) gets its loop (`runner`) and nothing else. A controller gets its
    role groups (`roles`) and, with a separate rollout pool, its side of the pool: the link,
    `send` (the actor's weights to the pool; the seconds it took), its controller rank, and
    what to do after the pool acknowledged the stop."""

    roles: Backend | None = None
    runner: Any = None  # rl3d.controller.rollout_pool.RolloutPoolRunner
    link: Any = None  # rl3d.single_controller.async_link.AsyncLink
    send: Callable[[], float] | None = None
    rank: int = 0
    on_stop: Callable[[], None] = lambda: None


class RunBackend(Protocol):
    def start(self, cfg: RL3DConfig, run_dir: Path, data: RunData, plan: Any) -> Started:
        """Start the pools' ranks (`plan`: the weight-sync plan with a separate rollout pool,
        else None); this process's part."""
        ...


def build_run(cfg: RL3DConfig, run_dir: Path, backend: RunBackend) -> Any:
    """This process's side of the run: the `RLTrainer` (its `fit()` trains), or on a rollout-pool
    rank the pool's loop (its `fit()` generates until the trainer stops)."""
    from rl3d.controller.placement import SeparatePool

    data = build_data(cfg)
    plan = None
    if is_separate(cfg):
        from rl3d.controller.rollout_pool import sync_plan

        plan = sync_plan(cfg, data.spec, role_pools(cfg)[0])
    started = backend.start(cfg, Path(run_dir), data, plan)
    if started.runner is not None:
        return started.runner
    placement = None
    if plan is not None:
        placement = SeparatePool(
            cfg,
            link=started.link,
            send=started.send,
            sync_bytes=plan.total_bytes,
            rank=started.rank,
            on_stop=started.on_stop,
        )
    return assemble_trainer(cfg, Path(run_dir), started.roles, data, placement=placement)
