"""Shared test setup.

TRITON_INTERPRET must be set before anything imports triton, so that Triton kernels run on
the CPU through Triton's interpreter. Where CUDA exists (tests/gpu on a GPU machine) it stays
unset, so the GPU tests run the compiled kernels, not the interpreter.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct HF directory (fetched once into the model cache), or a skip."""
    from rl3d.testing.real_model import real_model_dir

    return real_model_dir()
