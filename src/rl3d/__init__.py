"""rl3d: Megatron-centric 3D-parallel RL post-training with a 3D-HybridEngine."""

__version__ = "0.1.0"
