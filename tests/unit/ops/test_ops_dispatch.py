"""Which kernel form `rl3d.ops` picks, and the errors for forms that cannot run."""

import os
import subprocess
import sys

import pytest
import torch

from rl3d.ops import BACKEND_ENV, Backend, dispatch, reference, resolve_backend, strided_copy

CPU = torch.device("cpu")


def test_auto_takes_the_torch_reference_off_gpu(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, CPU) is Backend.TORCH
    assert resolve_backend("auto", CPU) is Backend.TORCH


def test_auto_prefers_cuda_then_triton_on_gpu_tensors(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dispatch, "_cuda_ext_available", lambda: True)
    assert resolve_backend("auto", cuda) is Backend.CUDA
    monkeypatch.setattr(dispatch, "_cuda_ext_available", lambda: False)
    monkeypatch.setattr(dispatch, "triton_importable", lambda: True)
    assert resolve_backend("auto", cuda) is Backend.TRITON
    monkeypatch.setattr(dispatch, "triton_importable", lambda: False)
    assert resolve_backend("auto", cuda) is Backend.TORCH


def test_environment_forces_a_form_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend(None, CPU) is Backend.TRITON
    assert resolve_backend("torch", CPU) is Backend.TORCH
    assert resolve_backend(Backend.TORCH, CPU) is Backend.TORCH


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU)


def test_forced_cuda_without_the_extension_is_an_error(monkeypatch):
    monkeypatch.setattr(dispatch, "_cuda_ext_available", lambda: False)
    with pytest.raises(RuntimeError, match="forced for cpu tensors"):
        resolve_backend("cuda", CPU)
    with pytest.raises(RuntimeError, match="neither built nor"):
        resolve_backend("cuda", torch.device("cuda", 0))


def test_unknown_backend_names_its_source(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend(None, CPU)
    with pytest.raises(ValueError, match="backend="):
        resolve_backend("cuda-graph", CPU)


def test_calls_route_to_the_chosen_form(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "strided_copy_into", lambda src, dst: calls.append((src, dst)))
    src, dst = torch.ones(3), torch.zeros(3)
    strided_copy(src, dst, backend="torch")
    assert calls == [(src, dst)] and not dst.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_extension_is_simply_absent_without_cuda():
    from rl3d.ops import cuda_ext

    assert cuda_ext.load() is None and not cuda_ext.available()


def test_importing_rl3d_ops_imports_no_triton():
    code = (
        "import sys, rl3d.ops\nsys.exit(int('triton' in sys.modules or 'rl3d._kernels_cuda' in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_bucket_arguments_are_checked():
    from rl3d.ops import pack_bucket, unpack_bucket

    with pytest.raises(ValueError, match="mix dtypes"):
        pack_bucket([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least 5"):
        pack_bucket([torch.zeros(2), torch.zeros(3)], out=torch.empty(4))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        unpack_bucket(torch.zeros(4, 2)[:, 0], [torch.empty(4)])
    mixed = pack_bucket([torch.ones(2), torch.ones(1, dtype=torch.float16)], dtype=torch.bfloat16)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, torch.ones(3, dtype=torch.bfloat16))
