"""The CUDA kernels are optional twice over: a failed compile at install skips the extension
instead of the install, and the JIT fallback says what it lacks (ninja) instead of failing."""

import ast
import logging
from pathlib import Path

import torch

from rl3d.ops import cuda_ext

SETUP = Path(__file__).resolve().parents[3] / "setup.py"


def _call(tree: ast.AST, name: str) -> ast.Call:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == name)


def test_the_extension_is_optional_and_the_gpu_extra_brings_ninja():
    tree = ast.parse(SETUP.read_text())
    keywords = {k.arg: k.value for k in _call(tree, "CUDAExtension").keywords}
    assert isinstance(keywords.get("optional"), ast.Constant) and keywords["optional"].value is True
    extras = next(k.value for k in _call(tree, "setup").keywords if k.arg == "extras_require")
    gpu = next(v for k, v in zip(extras.keys, extras.values) if k.value == "gpu")
    assert "ninja" in [e.value for e in gpu.elts if isinstance(e, ast.Constant)]


def test_jit_without_ninja_falls_back_naming_it(monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", lambda **_: (_ for _ in ()).throw(AssertionError("no build")))
    with caplog.at_level(logging.WARNING, logger=cuda_ext.logger.name):
        assert cuda_ext.load.__wrapped__() is None
    assert "needs ninja" in caplog.text
