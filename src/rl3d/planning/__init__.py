"""Plans made from a recipe before anything runs: per-rank GPU memory (`plan_memory`), the
step simulator (each stage's time on a device class) and the layout search over
resource pools (`rl3d plan --auto-layout`).

The names below load on first use: `rl3d plan`'s parser imports this package and must not pull
in torch (the memory plan reads a recipe's pools, whose module imports it).
"""

__all__ = ["MemoryPlan", "RankPlan", "plan_memory"]


def __getattr__(name: str):
    if name in __all__:
        from rl3d.planning import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'rl3d.planning' has no attribute {name!r}")
