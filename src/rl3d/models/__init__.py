"""Model shapes, megatron-core builders, converters and the CPU shim.

Importing this package does not import megatron-core; the builders do, lazily.
"""

from rl3d.models.spec import MODEL_SPECS, ModelSpec, get_model_spec

__all__ = ["MODEL_SPECS", "ModelSpec", "get_model_spec"]
