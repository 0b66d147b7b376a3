"""Benchmarks behind `rl3d bench`: the 3D-HybridEngine transition, modelled and measured."""
