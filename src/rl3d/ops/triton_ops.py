"""The Triton form of the resharding ops. Importing this module imports triton, so `rl3d.ops`
only imports it once a call has chosen the Triton form."""

from __future__ import annotations

from rl3d._kernels.triton.strided_copy import launch_strided_copy
from rl3d.ops.views import BlockOps, CopyBlock

# Elements per program (a module attribute so tests can shrink it to force many tiles).
MAX_TILE = 4096


def _run(blocks: list[CopyBlock]) -> None:
    for block in blocks:
        launch_strided_copy(block.src, block.dst, block.sizes, block.src_strides, block.dst_strides, MAX_TILE)


# The module-level ops rl3d.ops.dispatch calls, planned by `views.BlockOps` and run by `_run`.
_OPS = BlockOps(_run)
strided_copy_into = _OPS.strided_copy_into
pack_bucket_into = _OPS.pack_bucket_into
unpack_bucket_into = _OPS.unpack_bucket_into
gather_to_layout_into = _OPS.gather_to_layout_into
