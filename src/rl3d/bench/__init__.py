"""Benchmarks behind `rl3d bench`: the 3D-HybridEngine transition, modelled and measured.

Importing the package registers the baseline transition strategies
(`rl3d.hybrid_engine.baselines`) next to production's `hybridflow`, and hybridflow's per-node
routing (`hybridflow_hier`), so every benchmark and `rl3d plan` sees all five. The cost models
the benchmark shares with the planner live in `rl3d.costs`.
"""

from rl3d.hybrid_engine import baselines as _baselines  # noqa: F401  registers the baselines
from rl3d.hybrid_engine import hierarchical as _hierarchical  # noqa: F401  registers hybridflow_hier
