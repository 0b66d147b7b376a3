"""`logging.trackers`: where metrics go besides metrics.jsonl (`rl3d.logging.trackers`).

Each tracker is an optional package; a recipe naming one that is not installed fails here, at
config validation, with the pip extra that installs it (never at step 1 on a cluster).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rl3d.utils.imports import suggest


@dataclass(frozen=True)
class Tracker:
    module: str  # imported by the writer; looked up (not imported) when the config is checked
    install: str  # what to pip install when it is missing


TRACKERS = {
    "tensorboard": Tracker("tensorboard", "pip install tensorboard (a dependency of rl3d)"),
    "wandb": Tracker("wandb", "pip install 'rl3d[track]' (or: pip install wandb)"),
    "mlflow": Tracker("mlflow", "pip install 'rl3d[track]' (or: pip install mlflow-skinny)"),
}


def trackers_of(logging_cfg) -> list[str]:
    """The trackers a run writes to: `logging.trackers`, or by default TensorBoard unless
    `logging.tensorboard` is false."""
    if logging_cfg.trackers is not None:
        return list(dict.fromkeys(logging_cfg.trackers))
    return ["tensorboard"] if logging_cfg.tensorboard else []


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def check_trackers(cfg, fail) -> None:
    """Every named tracker is known and importable (`cfg` is the whole `RL3DConfig`)."""
    log = cfg.logging
    for i, name in enumerate(log.trackers or []):
        key = f"logging.trackers[{i}]"
        tracker = TRACKERS.get(name)
        if tracker is None:
            hint = suggest(name, list(TRACKERS))
            raise fail(key, f"unknown tracker {name!r}{hint}; known: {', '.join(TRACKERS)}")
        if name == "tensorboard" and not log.tensorboard:
            raise fail(key, "tensorboard is listed but logging.tensorboard is false; drop one of them")
        if not installed(tracker.module):
            raise fail(
                key,
                f"tracker {name!r} needs the {tracker.module!r} package, which is not installed: "
                + tracker.install,
            )
