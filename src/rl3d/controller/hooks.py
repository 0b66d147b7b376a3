"""User hooks named in ``trainer.hooks``: ``{on_step_end: "my_pkg.callbacks:log_lengths", ...}``.

A hook is called as ``fn(step=step, batch=batch, metrics=metrics)`` at its point of the loop:

- ``on_rollout_end``: after generation and scoring (`batch` holds the step's rollout);
- ``on_step_end``: after the update (`metrics` holds the step's metrics);
- ``on_checkpoint``: after a checkpoint is saved.

It may return a dict of extra metrics, merged into `metrics` (a returned key replaces an
existing one), or None. A hook that raises, or returns anything else, stops the run with
`HookError` naming the hook and its import path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl3d.utils.imports import import_object, suggest

HOOK_NAMES = ("on_rollout_end", "on_step_end", "on_checkpoint")


class HookError(RuntimeError):
    def __init__(self, message: str, *, hook: str, path: str):
        super().__init__(message)
        self.hook = hook
        self.path = path


@dataclass
class Hooks:
    fns: dict[str, Callable[..., Any]] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.fns

    def call(self, name: str, *, step: int, batch: Any, metrics: dict[str, Any]) -> dict[str, Any]:
        """Run hook `name` if configured; returns `metrics` with the hook's metrics merged in."""
        assert name in HOOK_NAMES, f"unknown hook point {name!r}"
        fn = self.fns.get(name)
        if fn is None:
            return metrics
        path = self.paths[name]
        try:
            extra = fn(step=step, batch=batch, metrics=metrics)
        except Exception as err:
            raise HookError(
                f"hook {name} ({path}) failed at step {step}: {type(err).__name__}: {err}",
                hook=name,
                path=path,
            ) from err
        if extra is None:
            return metrics
        if not isinstance(extra, dict):
            raise HookError(
                f"hook {name} ({path}) returned {type(extra).__name__}; expected a dict of metrics or None",
                hook=name,
                path=path,
            )
        metrics.update(extra)
        return metrics


def load_hooks(hooks_cfg: dict[str, str]) -> Hooks:
    """Import every hook of ``trainer.hooks`` now, so a typo fails before the first step."""
    hooks = Hooks()
    for name, path in hooks_cfg.items():
        if name not in HOOK_NAMES:
            known = ", ".join(HOOK_NAMES)
            raise ValueError(f"trainer.hooks.{name}: unknown hook{suggest(name, HOOK_NAMES)}; known: {known}")
        try:
            hooks.fns[name] = import_object(path, what=f"hook {name}")
        except ValueError as err:
            raise ValueError(f"trainer.hooks.{name}: {err}") from err
        hooks.paths[name] = path
    return hooks
