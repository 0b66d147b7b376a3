"""Benchmarks behind `rl3d bench`: the 3D-HybridEngine transition, modelled and measured.

Importing the package registers the baseline transition strategies (`baselines`) next to
production's `hybridflow`, so every benchmark and `rl3d plan` sees all four.
"""

from rl3d.bench import baselines as _baselines  # noqa: F401  registers the baselines
