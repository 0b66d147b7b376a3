"""Packaging for rl3d.

torch is deliberately a loose floor: pip must never resolve a fresh torch on its own
(it would pull a multi-GB CUDA build). `make install` installs the pinned CPU wheel first;
on a CUDA machine install your own torch build before `pip install -e .`.
"""

import os

from setuptools import find_packages, setup


def cuda_extensions() -> tuple[list, dict]:
    """rl3d._kernels_cuda, built only where CUDA is present (a GPU, or CUDA_HOME plus
    RL3D_BUILD_CUDA=1); anywhere else nothing, and never an error (a compile error too: the
    extension is optional): rl3d.ops falls back to
    Triton or torch, or JIT-builds the same sources on first use. Building it needs torch at
    build time: `pip install --no-build-isolation -e .` on a CUDA machine."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:  # isolated build without torch: ship the sources only
        return [], {}
    wanted = torch.cuda.is_available() or os.environ.get("RL3D_BUILD_CUDA") == "1"
    if not wanted or CUDA_HOME is None:
        return [], {}
    cuda_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "cuda")
    extension = CUDAExtension(
        name="rl3d._kernels_cuda",
        sources=["kernels/cuda/strided_copy.cu", "kernels/cuda/binding.cpp"],
        include_dirs=[cuda_dir],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        optional=True,  # a failed compile skips the extension, never the install
    )
    return [extension], {"build_ext": BuildExtension}


EXT_MODULES, CMDCLASS = cuda_extensions()
# Upper bounds only where a known incompatibility exists, each saying which; the locks in
# constraints/ (`make install`, `make lock`), not caps, keep installs reproducible. megatron-core
# 0.17+ requires Python 3.12 itself, so on 3.11 pip resolves 0.16.x without a cap here.
MEGATRON = "megatron-core>=0.16"
# The [gpu] extra follows SGLang's own pins (its wheel's METADATA; tests/unit/rollout checks that
# they agree): sglang 0.5.23 requires torch==2.14.1 (CUDA 13 builds: flashinfer-python[cu13],
# cuda-python>=13) and transformers==5.19.0. Transformer Engine is built against that torch, in
# megatron-core 0.16's range: `make install-gpu`. Caps: rl3d's SGLang adapter is checked against
# 0.5.23's own source (tests/unit/rollout), and megatron-core 0.16 supports Transformer Engine < 2.12.
SGLANG = "sglang==0.5.23"
GPU_TORCH = "torch==2.14.1"
TRANSFORMER_ENGINE = "transformer-engine[core_cu13,pytorch]>=2.9,<2.12"
# Experiment trackers beside TensorBoard (`logging.trackers`; rl3d.config.tracking names this
# extra when one is missing). In [dev] too, so CI runs their tests: about 70 s more install
# from an empty pip cache (README). mlflow-skinny: the tracking client without the server.
TRACK = ["wandb>=0.20", "mlflow-skinny>=2.10"]  # wandb: reinit="create_new"
# `rl3d models fetch` dequantizes a GGUF checkpoint with transformers, which needs these
# (rl3d.models.hub.CONVERTER_PACKAGES). In [dev] too, so CI's real-model tests run.
REAL = ["gguf>=0.10", "accelerate>=1.0"]
# `rollout.agent` hands agents an `openai.OpenAI` client pointed at the rollout's endpoint
# (rl3d.agents). In [dev] too, so the tests drive the endpoint with the real client.
AGENTS = ["openai>=1.40"]
# `actor.lora` reads and writes PEFT adapter directories itself; `peft` is what users load them
# with, and the tests check the round trip against it. In [dev] too, so CI runs them.
LORA = ["peft>=0.13"]

setup(
    name="rl3d",
    version="0.1.0",
    description="Megatron-centric 3D-parallel RL post-training with a 3D-HybridEngine",
    python_requires=">=3.10",
    # kernels/ (Triton modules and CUDA sources) ships inside the wheel as `rl3d._kernels.triton`
    # and `rl3d._kernels.cuda`; `rl3d._kernels` itself is src/rl3d/_kernels, so kernels/ needs no
    # __init__.py and never shadows an installed top-level `kernels` (tests/unit/test_no_shadowing.py).
    package_dir={"": "src", "rl3d._kernels.triton": "kernels/triton", "rl3d._kernels.cuda": "kernels/cuda"},
    packages=find_packages("src") + ["rl3d._kernels.triton", "rl3d._kernels.cuda"],
    package_data={"rl3d._kernels.cuda": ["*.cu", "*.cpp", "*.h", "*.cuh"]},
    install_requires=[
        "torch>=2.3",
        MEGATRON,
        "pyyaml>=6",
        "tensorboard>=2.14",
        "ray>=2.9",
        "pyarrow>=14",
        "safetensors>=0.4",
        "transformers>=4.40",
        "numpy",
        "packaging",
        "psutil",  # megatron-core's dist-checkpoint writer
        "matplotlib",
        "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # CUDA-only: never installed on CPU machines (`make install-gpu`). apex: see README.
        "gpu": [GPU_TORCH, SGLANG, TRANSFORMER_ENGINE, "ninja"],  # ninja: the kernels' JIT build
        "track": TRACK,
        "real": REAL,
        "agents": AGENTS,
        "lora": LORA,
        "dev": ["pytest>=8", "pytest-timeout", "ruff>=0.5", "hypothesis>=6", *TRACK, *REAL, *AGENTS, *LORA],
    },
    entry_points={"console_scripts": ["rl3d=rl3d.cli:main"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
