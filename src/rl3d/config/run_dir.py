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


def teacher_weights(path: str | Path) -> tuple[Any, str]:
    """The model `path` names, as `(its ModelSpec, the directory its weights load from)`: an rl3d
    run directory or `checkpoints/step_N` (the actor's dist checkpoint, any layout; shapes from
    the run's model section), else an HF directory or a known model's name (`rl3d.models.hub`)."""
    from rl3d.models.hub import resolve_model_path
    from rl3d.models.spec import spec_in_dir, spec_of

    found = checkpoint_teacher(path)
    if found is not None:
        model, actor_dir = found
        return spec_of(model), str(actor_dir)
    directory = resolve_model_path(str(path))
    return spec_in_dir(directory), directory


def preflight_teachers(cfg: Any, fail, *, absent_ok: bool = False) -> None:
    """At launch (`rl3d.launch.preflight`): each distillation teacher is there, reads the run's
    vocabulary, and its layout fits it (tp | KV heads, pp | layers)."""
    from rl3d.models.spec import spec_of

    distill = cfg.algorithm.distill
    if not cfg.algorithm.family.needs_teacher:
        return
    vocab = spec_of(cfg.model).vocab_size
    par, where = (cfg.actor.parallel, "actor.parallel") if distill.colocate else (distill.parallel, None)
    where = where or "algorithm.distill.parallel"
    for path in distill.paths():
        key = (
            "algorithm.distill.teacher" if path == distill.teacher else "algorithm.distill.teachers_by_source"
        )
        if absent_ok and not Path(path).exists():
            continue
        try:
            spec, _ = teacher_weights(path)
        except (FileNotFoundError, ValueError) as err:
            raise fail(key, f"teacher {path}: {err}") from None
        if spec.vocab_size != vocab:
            raise fail(key, f"teacher {path} has {spec.vocab_size} token ids, the student {vocab}")
        if spec.num_query_groups % par.tp:
            raise fail(
                f"{where}.tp", f"tp={par.tp} must divide teacher {path}'s {spec.num_query_groups} KV heads"
            )
        if spec.num_layers % par.pp:
            raise fail(f"{where}.pp", f"pp={par.pp} must divide teacher {path}'s {spec.num_layers} layers")
