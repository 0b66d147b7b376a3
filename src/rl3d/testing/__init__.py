"""Helpers for rl3d's tests that other packages' tests reuse (spawned gloo worlds, tiny models)."""
