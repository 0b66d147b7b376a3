"""The CPU shim: active on CPU, idempotent, version-checked, and scoped to megatron's modules."""

import importlib

import pytest
import torch

from rl3d.models import cpu_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim is inactive with CUDA")


def test_activate_is_idempotent_and_active_on_cpu():
    assert cpu_shim.activate() is True
    assert cpu_shim.activate() is True
    assert cpu_shim.is_active()


def test_version_check():
    assert cpu_shim.check_version("0.16.1") == "0.16.1"
    assert cpu_shim.check_version("0.13.1") == "0.13.1"
    assert cpu_shim.check_version("0.19.2") == "0.19.2"
    with pytest.raises(RuntimeError, match="0.17.0 is not one the rl3d CPU shim was checked against"):
        cpu_shim.check_version("0.17.0")


def test_version_override_warns(monkeypatch, caplog):
    monkeypatch.setenv("RL3D_ALLOW_UNTESTED_MEGATRON", "1")
    assert cpu_shim.check_version("0.99.0") == "0.99.0"
    assert "0.99.0" in caplog.text


def test_installed_version_is_known():
    import megatron.core

    assert cpu_shim.check_version() == megatron.core.__version__


@pytest.mark.parametrize("module_name", cpu_shim._DEVICE_LITERAL_MODULES)
def test_patched_modules_make_cuda_tensors_on_cpu(module_name):
    cpu_shim.activate()
    module = importlib.import_module(module_name)
    assert module.torch.zeros(2, device="cuda").device.type == "cpu"
    assert module.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert module.torch.empty(3, device=module.torch.cuda.current_device()).device.type == "cpu"
    assert module.torch.Tensor is torch.Tensor  # everything else is the real torch


def test_global_torch_untouched():
    cpu_shim.activate()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.Tensor.type is cpu_shim._tensor_type
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_grad_clip_type_assert_passes_on_cpu():
    cpu_shim.activate()
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(param.grad, torch.full((4,), 0.5), rtol=1e-5, atol=0)
    assert torch.zeros(1).type() == "torch.FloatTensor"  # the type-name remap ended with the call


def test_grad_norm_on_cpu():
    cpu_shim.activate()
    from megatron.core.optimizer import clip_grads

    grads = [torch.full((4,), 3.0), torch.full((9,), 4.0)]
    norm_sq, _ = clip_grads.multi_tensor_applier(
        clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int), [grads], False
    )
    assert norm_sq.device.type == "cpu" and norm_sq.dtype == torch.float64  # summed in fp64
    assert norm_sq.item() == pytest.approx((4 * 9 + 9 * 16) ** 0.5)


def test_grad_norm_in_chunks_equals_the_whole_fp64_sum():
    """The norm summed over cache-sized fp64 chunks against each gradient's whole fp64 copy, on
    tensors of SmolLM2-135M's shapes (the output layer's 49152 x 576 and one decoder layer's):
    within 1e-15 relative, and megatron's fp32 clip coefficient the same."""
    cpu_shim.activate()
    from megatron.core.optimizer import clip_grads

    gen = torch.Generator().manual_seed(0)
    shapes = [(49152, 576), (960, 576), (576, 576), (3072, 576), (576, 1536), (576,), (5,)]
    grads = [torch.randn(s, generator=gen) * 10.0 ** -torch.randint(1, 5, (), generator=gen) for s in shapes]
    norm, _ = clip_grads.multi_tensor_applier(
        clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int), [grads], False
    )
    whole = sum(g.double().square().sum() for g in grads).sqrt()
    assert abs(norm.item() - whole.item()) <= 1e-15 * whole.item()
    max_norm = 1.0
    assert (max_norm / (norm.float() + 1e-6)).item() == (max_norm / (whole.float() + 1e-6)).item()


def test_memory_buffer_on_cpu(groups_1x1):
    from megatron.core import parallel_state

    buf = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "test")
    assert buf.shape == (2, 3) and buf.device.type == "cpu"


def test_rng_tracker_forks_cpu_generator(groups_1x1):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the outer stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advances


def test_cuda_tensor_method_scopes_nest():
    """LLaVA's CLIP ViT constructor runs in a scope, and the GPTModel it builds enters another:
    leaving the inner one keeps the outer one's remap, leaving the outer one undoes it."""
    with cpu_shim._cuda_tensor_methods():
        with cpu_shim._cuda_tensor_methods():
            assert torch.arange(2).cuda().device.type == "cpu"
        assert torch.arange(2).cuda().device.type == "cpu"
    assert torch.Tensor.cuda is cpu_shim._tensor_cuda and torch.Tensor.type is cpu_shim._tensor_type


def test_clip_vit_builds_on_cpu_without_transformer_engine(groups_1x1):
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer import TransformerConfig

    cpu_shim.define_clip_vit_norm_without_te()
    cpu_shim.define_clip_vit_norm_without_te()  # idempotent
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True, add_bias_linear=True
    )
    vit = CLIPViTModel(config, get_vit_layer_with_local_spec(), img_h=8, img_w=8, patch_dim=4)
    assert vit.position_ids.device.type == "cpu"
    assert vit(torch.randn(1, 3, 8, 8)).shape == (1, 5, 8)  # 4 patches and the class token
