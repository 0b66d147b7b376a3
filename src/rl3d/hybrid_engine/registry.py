"""The strategy registry: name -> `rl3d.hybrid_engine.strategy.Strategy` subclass.

It holds only names and classes (no plan or executor types), so the planner and the executor
look strategies up without importing the modules that define them."""

from __future__ import annotations

from typing import Any

from rl3d.utils.registry import Registry

STRATEGIES: Registry[Any] = Registry(
    "strategy", note="(the benchmark baselines register on `import rl3d.bench`)"
)


def register_strategy(cls: Any) -> Any:
    """Class decorator: make a `Strategy` subclass plannable by its `name`."""
    STRATEGIES.register(cls.name, cls)
    return cls


def get_strategy(name: str) -> Any:
    return STRATEGIES.get(name)
