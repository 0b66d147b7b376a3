"""The CUDA sources compile, so that a broken .cu never lands; running them is tests/gpu's job.

strided_copy.cu includes no torch header (plain pointers), so nvcc alone checks it; binding.cpp
is the only file that sees torch, and the host compiler checks it against torch's headers.
"""

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from rl3d.ops import cuda_ext

NVCC = shutil.which("nvcc")
CXX = shutil.which("g++") or shutil.which("c++")
SOURCE_DIR = Path(cuda_ext.source_dir())


def torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"], str(SOURCE_DIR)]]


def test_the_sources_ship_in_the_package():
    assert {path.name for path in SOURCE_DIR.iterdir()} >= {*cuda_ext.SOURCES, "strided_copy.h"}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("source", sorted(p.name for p in SOURCE_DIR.glob("*.cu")))
def test_cu_compiles_with_nvcc(source, tmp_path):
    command = [NVCC, "-c", "-std=c++17", "-O2", *torch_includes(), str(SOURCE_DIR / source),
               "-o", str(tmp_path / "kernel.o")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "kernel.o").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
def test_binding_compiles_against_torch_headers():
    # torch's own extension builds use C++20 for its headers; match them.
    command = [CXX, "-fsyntax-only", "-std=c++20", "-DTORCH_EXTENSION_NAME=rl3d_kernels_cuda",
               *torch_includes(), str(SOURCE_DIR / "binding.cpp")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
