"""`launch.slurm`: the cluster settings `rl3d slurm` writes into its sbatch script
(`rl3d.launch.slurm_script`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    gpus_per_node: int = 8
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    requeue: bool = True
