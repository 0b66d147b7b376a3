"""Triton strided copy with a fused dtype cast: the one kernel behind every resharding op.

`rl3d.ops.views` reduces pack/unpack, gather_to_layout and strided copies to copies of at most
three dimensions [batch, row, col] with arbitrary element strides on both sides; this kernel runs
one of them. Programs walk a 1-D grid of [BLOCK_R, BLOCK_C] tiles, because CUDA caps the second
and third grid axes at 65535 and a 70B-sized tensor needs more tiles than that.
"""

import triton
import triton.language as tl


@triton.jit
def _bf16_to_fp32(values):
    # A bfloat16 is the top half of a float32. Done by hand because the Triton interpreter
    # flushes bfloat16 subnormals in `.to(tl.float32)`.
    widened = values.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return widened.to(tl.float32, bitcast=True)


@triton.jit
def _fp32_to_bf16(values):
    # Round to nearest even, NaN to 0x7FC0, as torch does. Done by hand because the Triton
    # interpreter truncates in `.to(tl.bfloat16)`, and CPU tests must match GPU results bit for bit.
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(values, dst_dtype: tl.constexpr):
    """Convert through float32, like torch: exact widening, one round-to-nearest-even."""
    if values.dtype == dst_dtype:
        return values
    elif values.dtype == tl.bfloat16:
        return _bf16_to_fp32(values).to(dst_dtype)
    elif dst_dtype == tl.bfloat16:
        return _fp32_to_bf16(values.to(tl.float32))
    else:
        return values.to(dst_dtype)


@triton.jit
def strided_copy_kernel(
    src_ptr,
    dst_ptr,
    num_rows,
    num_cols,
    src_batch_stride,
    src_row_stride,
    src_col_stride,
    dst_batch_stride,
    dst_row_stride,
    dst_col_stride,
    num_row_blocks,
    num_col_blocks,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    col_block = tile % num_col_blocks
    row_block = (tile // num_col_blocks) % num_row_blocks
    batch = tile // (num_col_blocks * num_row_blocks)
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    src_offsets = batch * src_batch_stride + rows[:, None] * src_row_stride + cols[None, :] * src_col_stride
    dst_offsets = batch * dst_batch_stride + rows[:, None] * dst_row_stride + cols[None, :] * dst_col_stride
    values = tl.load(src_ptr + src_offsets, mask=mask)
    tl.store(dst_ptr + dst_offsets, _cast(values, dst_ptr.dtype.element_ty), mask=mask)


def tile_shape(num_rows: int, num_cols: int, max_tile: int) -> tuple[int, int]:
    """A [BLOCK_R, BLOCK_C] tile: as wide as the rows allow (contiguous runs), then as tall as
    `max_tile` elements leave room for."""
    block_cols = min(triton.next_power_of_2(num_cols), max_tile)
    block_rows = min(triton.next_power_of_2(num_rows), max(1, max_tile // block_cols))
    return block_rows, block_cols


def launch_strided_copy(src, dst, sizes, src_strides, dst_strides, max_tile: int = 4096) -> None:
    """Run one [batch, row, col] copy; `src`/`dst` are tensors whose data pointers start the block."""
    num_batches, num_rows, num_cols = sizes
    block_rows, block_cols = tile_shape(num_rows, num_cols, max_tile)
    num_row_blocks = triton.cdiv(num_rows, block_rows)
    num_col_blocks = triton.cdiv(num_cols, block_cols)
    grid = (num_batches * num_row_blocks * num_col_blocks,)
    strided_copy_kernel[grid](
        src,
        dst,
        num_rows,
        num_cols,
        *src_strides,
        *dst_strides,
        num_row_blocks,
        num_col_blocks,
        BLOCK_R=block_rows,
        BLOCK_C=block_cols,
    )
