"""Floating-point dtypes by the names recipes and benchmarks use: the one map from a name to its
size in bytes (pure Python, for planners that never import torch) and to its torch dtype.

    DTYPE_BYTES["bf16"]         # 2
    torch_dtype("bfloat16")     # torch.bfloat16
"""

from __future__ import annotations

from typing import Any

from rl3d.utils.imports import suggest

# name -> (torch's name, bytes per element); the short names are aliases of the long ones
_DTYPES = {
    "float32": ("float32", 4),
    "fp32": ("float32", 4),
    "bfloat16": ("bfloat16", 2),
    "bf16": ("bfloat16", 2),
    "float16": ("float16", 2),
    "fp16": ("float16", 2),
}
DTYPE_BYTES = {name: nbytes for name, (_, nbytes) in _DTYPES.items()}


def torch_dtype(name: str) -> Any:
    """The torch dtype of `name` (``float32``, ``bfloat16``, ``float16`` or a short alias)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}{suggest(name, _DTYPES)}; known: {', '.join(_DTYPES)}")
    import torch

    return getattr(torch, _DTYPES[name][0])
