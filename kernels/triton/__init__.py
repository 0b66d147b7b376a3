"""Resharding kernels shipped with rl3d (see rl3d.ops)."""
