"""Parallel layouts (pure Python) and, in `groups`, the process groups built from them."""

from rl3d.parallel.layout import GenCoords, GenerationLayout, ParallelLayout, RankCoords

__all__ = ["GenCoords", "GenerationLayout", "ParallelLayout", "RankCoords"]
