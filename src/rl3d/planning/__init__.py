"""Plans made from a recipe before anything runs: per-rank GPU memory (`plan_memory`), the
step simulator (each stage's time on a device class) and the automatic placement search over
resource pools (`rl3d plan --auto-place`)."""

from rl3d.planning.memory import MemoryPlan, RankPlan, plan_memory

__all__ = ["MemoryPlan", "RankPlan", "plan_memory"]
