"""A run's checkpointed actor as an HF directory: `rl3d export RUN_DIR --dst DIR [--step N]`.

The run's own record says what to build: `RUN_DIR/resolved_config.yaml` gives the model section
(`model.name`, or the HF directory whose config.json has the shapes, and whose config and
tokenizer files the export carries over), `RUN_DIR/checkpoints/step_N` the weights (the newest
complete checkpoint unless `--step`; its manifest's sizes are checked first). The conversion
itself is `rl3d.models.export.export_hf`: one process, any layout, written atomically.
"""

from __future__ import annotations

from pathlib import Path

from rl3d.checkpoint.manager import CheckpointManager
from rl3d.checkpoint.manifest import verify


def run_model_config(run_dir: Path):
    """The `model` section of the run's resolved config (`rl3d.config.ModelConfig`)."""
    from rl3d.config.run_dir import run_model_section

    return run_model_section(run_dir)


def export_run(
    run_dir: str | Path, dst: str | Path, *, step: int | None = None, max_shard_bytes: int = 5 * 2**30
) -> tuple[int, Path]:
    """Export step `step` (default: the newest complete one) of the run in `run_dir` to `dst`;
    returns (step, dst)."""
    from rl3d.config.roles import ACTOR
    from rl3d.models.export import export_hf
    from rl3d.models.spec import spec_of

    run_dir = Path(run_dir)
    model = run_model_config(run_dir)
    found = dict(CheckpointManager(run_dir / "checkpoints", keep_last=1).checkpoints())
    if not found:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no complete checkpoint to export")
    step = max(found) if step is None else step
    if step not in found:
        raise ValueError(f"{run_dir}: no checkpoint of step {step}; there are steps {sorted(found)}")
    problem = verify(found[step])
    if problem:
        raise ValueError(f"checkpoint of step {step} is damaged: {problem}")
    if (found[step] / "reward_model").is_dir():  # a reward-model job's (rl3d.controller.rm_train)
        from rl3d.workers.reward_model import export_reward_model_hf

        return step, export_reward_model_hf(found[step] / "reward_model", dst)
    path = export_hf(
        found[step] / ACTOR, spec_of(model), dst, source=model.hf_path, max_shard_bytes=max_shard_bytes
    )
    return step, path
