"""A run built once for any (config, backend): `build_run`.

A backend (`rl3d.launch.spmd_backend.SPMDRun` under torchrun, `rl3d.launch.ray_launch.RayRun`
for the Ray driver) starts the processes: the ranks of the placement's trainer pools with their
role workers, and what the placement asks for through the backend's one `PoolHost` method (a
separate rollout pool's ranks, the link to them and the weight bridge). It hands back this
process's part (`Started`). Everything else is built here: data and tokenizer, the placement
(which owns the weight-sync plan and what it starts on the backend,
`rl3d.controller.placement`), and the controller around the role groups
(`rl3d.controller.assemble`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rl3d.config import RL3DConfig
from rl3d.controller.assemble import Backend, RunData, assemble_trainer, build_data
from rl3d.controller.placement import Placement, placement_of


@dataclass
class Started:
    """This process's part of a run, as the backend started it: a controller's role groups
    (`roles`), or the loop of a process that became a rollout-pool rank (spmd: `runner`)."""

    roles: Backend | None = None
    runner: Any = None  # rl3d.controller.rollout_pool.RolloutPoolRunner


class RunBackend(Protocol):
    def start(self, cfg: RL3DConfig, run_dir: Path, data: RunData, placement: Placement) -> Started:
        """Start the ranks of the placement's trainer pools, and what the placement starts
        through the backend's `PoolHost` (`placement.launch`); this process's part."""
        ...


def build_run(cfg: RL3DConfig, run_dir: Path, backend: RunBackend) -> Any:
    """This process's side of the run: the `RLTrainer` (its `fit()` trains), or on a rollout-pool
    rank the pool's loop (its `fit()` generates until the trainer stops)."""
    data = build_data(cfg)
    placement = placement_of(cfg, data.spec)
    started = backend.start(cfg, Path(run_dir), data, placement)
    if started.runner is not None:
        return started.runner
    return assemble_trainer(cfg, Path(run_dir), started.roles, data, placement=placement)
