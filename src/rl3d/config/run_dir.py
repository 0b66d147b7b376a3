"""What an rl3d run directory holds, read without the run's code: its resolved `model` section,
and the actor's weights of a checkpoint (for a frozen role started from a run, such as a
distillation teacher, `rl3d.workers.teacher`).

    runs/x/resolved_config.yaml           the run's recipe, resolved
    runs/x/checkpoints/step_N/meta.json   written last: the checkpoint is complete
    runs/x/checkpoints/step_N/actor/      the actor's megatron dist checkpoint, any layout
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl3d.config.loader import RESOLVED_NAME, yaml_load
from rl3d.config.schema import ModelConfig
from rl3d.config.typed import from_dict

CHECKPOINTS, COMPLETE_MARK, ACTOR_DIR = "checkpoints", "meta.json", "actor"  # rl3d.checkpoint's names


def run_model_section(run_dir: str | Path) -> ModelConfig:
    """The `model` section (`rl3d.config.ModelConfig`) of an rl3d run's resolved config."""
    path = Path(run_dir) / RESOLVED_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no {RESOLVED_NAME}: not an rl3d run directory")
    data = yaml_load(path.read_text()) or {}
    return from_dict(ModelConfig, data.get("model") or {}, prefix="model", source_of=lambda _: str(path))


def checkpoint_teacher(path: str | Path) -> tuple[Any, Path] | None:
    """`(model section, the actor's dist checkpoint directory)` when `path` is an rl3d run
    directory (its newest complete checkpoint) or one of its `checkpoints/step_N`; None for
    anything else (an HF directory). FileNotFoundError when a run has no complete checkpoint."""
    path = Path(path)
    if path.name.startswith("step_") and path.parent.name == CHECKPOINTS and (path / ACTOR_DIR).is_dir():
        if not (path / COMPLETE_MARK).is_file():
            raise FileNotFoundError(f"{path}: an incomplete checkpoint (no {COMPLETE_MARK})")
        return run_model_section(path.parent.parent), path / ACTOR_DIR
    if not (path / CHECKPOINTS).is_dir():
        return None
    steps = [
        p
        for p in (path / CHECKPOINTS).glob("step_*")
        if p.name[5:].isdigit() and (p / COMPLETE_MARK).is_file() and (p / ACTOR_DIR).is_dir()
    ]
    if not steps:
        raise FileNotFoundError(f"{path / CHECKPOINTS}: no complete checkpoint with the actor's weights")
    return run_model_section(path), max(steps, key=lambda p: int(p.name[5:])) / ACTOR_DIR
