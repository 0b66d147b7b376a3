"""The CUDA form of the resharding ops, and the loader of its extension.

The extension is `rl3d._kernels_cuda` when setup.py built it; otherwise it is JIT-built from the
sources shipped in `rl3d._kernels.cuda` on first use, where CUDA is present. Its absence is never
an error here: `available()` says False and `rl3d.ops` picks another form. Set
RL3D_CUDA_JIT=0 to skip the JIT build (it takes about a minute the first time).
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import resources
from types import ModuleType

import torch

from rl3d.ops.views import BlockOps, CopyBlock

logger = logging.getLogger(__name__)

EXTENSION_NAME = "rl3d_kernels_cuda"
SOURCES = ("strided_copy.cu", "binding.cpp")


def source_dir() -> str:
    return str(resources.files("rl3d._kernels.cuda"))


@functools.cache
def load() -> ModuleType | None:
    """The built extension, or None (with the reason logged once) where it cannot be had."""
    try:
        from rl3d import _kernels_cuda  # built by setup.py with RL3D_BUILD_CUDA=1

        return _kernels_cuda
    except ImportError:
        pass
    # Whether this process can reach a GPU at all decides if a JIT build is worth trying.
    if not torch.cuda.is_available():
        logger.debug("rl3d CUDA kernels unavailable: no CUDA device")
        return None
    if os.environ.get("RL3D_CUDA_JIT", "1") == "0":
        logger.info("rl3d CUDA kernels unavailable: not built and RL3D_CUDA_JIT=0")
        return None
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        logger.warning("rl3d CUDA kernels unavailable: CUDA_HOME not found, cannot JIT-build")
        return None
    if not cpp_extension.is_ninja_available():
        logger.warning("rl3d CUDA kernels unavailable: the JIT build needs ninja (pip install ninja)")
        return None
    directory = source_dir()
    try:
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[os.path.join(directory, name) for name in SOURCES],
            extra_include_paths=[directory],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    except Exception as error:  # a failed build must leave the Triton and torch forms usable
        logger.warning("rl3d CUDA kernels unavailable: JIT build failed: %s", error)
        return None


def available() -> bool:
    return load() is not None


def _run(blocks: list[CopyBlock]) -> None:
    extension = load()
    assert extension is not None, "cuda_ext used without the extension"
    for block in blocks:
        with torch.cuda.device(block.dst.device):
            stream = torch.cuda.current_stream(block.dst.device).cuda_stream
            extension.strided_copy(
                block.src, block.dst, [*block.sizes], [*block.src_strides], [*block.dst_strides], stream
            )


# The module-level ops rl3d.ops.dispatch calls, planned by `views.BlockOps` and run by `_run`.
_OPS = BlockOps(_run)
strided_copy_into = _OPS.strided_copy_into
pack_bucket_into = _OPS.pack_bucket_into
unpack_bucket_into = _OPS.unpack_bucket_into
gather_to_layout_into = _OPS.gather_to_layout_into
