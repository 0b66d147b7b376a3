"""A one-process gloo world with megatron initialised, shared by the tests of this package."""

import datetime

import pytest
import torch
import torch.distributed as dist

from rl3d.testing.spawn import free_port


@pytest.fixture(scope="module")
def groups_1x1():
    """MegatronGroups of a 1-1-1 layout in this process (torch.distributed: gloo, world 1).

    Module-scoped, so the process group is gone before other packages' tests run.
    """
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    owns_world = not dist.is_initialized()
    if owns_world:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1234)
    yield groups
    destroy_megatron()
    if owns_world:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """HF directories of random tiny-llama (untied) and tiny-qwen2 (tied, QKV bias), fp32."""
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in ("tiny-llama", "tiny-qwen2"):
        save_tiny_hf_model(name, root / name, seed=7)
        dirs[name] = root / name
    torch.manual_seed(0)
    return dirs


MOE_FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-glm4-moe", "tiny-deepseek-v3")


@pytest.fixture(scope="session")
def tiny_moe_hf_dirs(tmp_path_factory):
    """HF directories of random tiny Qwen3 (q/k norm, tied), Qwen3-MoE, Qwen2-MoE (shared
    expert) and GLM-4.5 (sigmoid router with a random correction bias, dense first layer,
    partial RoPE) and DeepSeek-V3 (MLA, grouped sigmoid router), fp32, in the hub's per-expert
    layout (`save_pretrained`)."""
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf-moe")
    for name in MOE_FAMILIES:
        save_tiny_hf_model(name, root / name, seed=11)
    torch.manual_seed(0)
    return {name: root / name for name in MOE_FAMILIES}
