"""Small helpers shared by several packages (no torch, no distributed state)."""

from rl3d.utils.imports import import_object, suggest

__all__ = ["import_object", "suggest"]
