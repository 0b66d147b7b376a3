"""The Triton form of the resharding ops. Importing this module imports triton, so `rl3d.ops`
only imports it once a call has chosen the Triton form."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl3d._kernels.triton.strided_copy import launch_strided_copy
from rl3d.ops.gather import GatheredShards, ParamLayout
from rl3d.ops.views import CopyBlock, copy_blocks, gather_blocks, pack_blocks, unpack_blocks

# Elements per program (a module attribute so tests can shrink it to force many tiles).
MAX_TILE = 4096


def _run(blocks: list[CopyBlock]) -> None:
    for block in blocks:
        launch_strided_copy(block.src, block.dst, block.sizes, block.src_strides, block.dst_strides, MAX_TILE)


def strided_copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    _run(copy_blocks(src, dst))


def pack_bucket_into(tensors: Sequence[torch.Tensor], bucket: torch.Tensor) -> None:
    _run(pack_blocks(tensors, bucket))


def unpack_bucket_into(bucket: torch.Tensor, destinations: Sequence[torch.Tensor]) -> None:
    _run(unpack_blocks(bucket, destinations))


def gather_to_layout_into(
    shards: Sequence[torch.Tensor] | GatheredShards,
    layout: ParamLayout,
    *,
    train_tp: int,
    gen_tp: int,
    gen_rank: int,
    target: str,
    out: torch.Tensor,
) -> None:
    _run(
        gather_blocks(
            shards, layout, train_tp=train_tp, gen_tp=gen_tp, gen_rank=gen_rank, target=target, out=out
        )
    )
