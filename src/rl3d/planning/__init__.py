"""Plans made from a recipe before anything runs: per-rank GPU memory (`plan_memory`)."""

from rl3d.planning.memory import MemoryPlan, RankPlan, plan_memory

__all__ = ["MemoryPlan", "RankPlan", "plan_memory"]
