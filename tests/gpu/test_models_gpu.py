"""On a GPU the megatron-core CPU shim is provably inactive: nothing of megatron is remapped."""

import importlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the shim is only inactive on GPU"),
]


def test_cpu_shim_inactive_on_gpu():
    from rl3d.models import cpu_shim

    assert cpu_shim.activate() is False
    assert cpu_shim.activate() is False  # and stays so
    assert not cpu_shim.is_active()
    for name in cpu_shim._DEVICE_LITERAL_MODULES:
        module = importlib.import_module(name)
        assert module.torch is torch, f"{name}.torch was remapped on a GPU"
    assert torch.Tensor.type is cpu_shim._tensor_type
    assert torch.Tensor.cuda is cpu_shim._tensor_cuda

    from megatron.core import parallel_state, utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mrandom

    assert parallel_state.GlobalMemoryBuffer is utils.GlobalMemoryBuffer
    assert utils.GlobalMemoryBuffer.__module__ == "megatron.core.utils"
    assert clip_grads.clip_grad_by_total_norm_fp32.__module__ == "megatron.core.optimizer.clip_grads"
    assert mrandom.initialize_rng_tracker.__module__ == "megatron.core.tensor_parallel.random"


def test_init_megatron_on_gpu_keeps_shim_off(tmp_path):
    import datetime

    import torch.distributed as dist

    from rl3d.models import cpu_shim
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.testing.spawn import free_port

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        groups = init_megatron(ParallelLayout(1, 1, 1))
        assert not cpu_shim.is_active()
        model = build_gpt(get_model_spec("tiny-llama"), groups)
        assert next(model.parameters()).is_cuda
        ids = torch.randint(0, 256, (2, 8), device="cuda")
        logits = model(ids, torch.arange(8, device="cuda").expand(2, 8), None)
        assert logits.shape == (2, 8, 256) and logits.is_cuda
        destroy_megatron()
    finally:
        dist.destroy_process_group()
