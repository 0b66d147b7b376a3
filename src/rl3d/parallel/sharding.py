"""How each kind of Megatron parameter is split over tensor-parallel ranks (pure Python).

The tensor operations that implement these kinds live in `rl3d.ops.layouts`; this module
holds only what the planner needs, so planning never imports torch.
"""

from __future__ import annotations

from enum import Enum


class ShardKind(str, Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    QKV = "qkv"
    SWIGLU_FC1 = "swiglu_fc1"
    VOCAB = "vocab"

    @property
    def tp_dim(self) -> int | None:
        if self is ShardKind.REPLICATED:
            return None
        return 1 if self is ShardKind.ROW else 0


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: round up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
