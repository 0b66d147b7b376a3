"""A mixture of experts' activations in the memory plan are what megatron's MoE layer keeps:
the saved tensors of a built layer's forward (tiny Qwen3-MoE, and tiny Qwen2-MoE with a shared
expert and a softmax over all experts) equal the plan's count; a real MoE model's MLP keeps
about twice what a dense SwiGLU of its `ffn_hidden_size` would (the count the plan used before)."""

import pytest
import torch

from rl3d.engine import MegatronEngine
from rl3d.models.spec import get_model_spec
from rl3d.planning.memory_activations import moe_bytes

TOKENS = 256


def _saved_bytes(module: torch.nn.Module, frozen: set[int], x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in frozen:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_the_plan_counts_what_the_moe_layer_keeps(groups_1x1, name):
    spec = get_model_spec(name)
    model = MegatronEngine(spec, groups_1x1, role="actor", params_dtype=torch.float32, seed=3).unwrapped()
    mlp = dict(model.named_modules())["decoder.layers.0.mlp"]
    assert type(mlp).__name__ == "MoELayer"
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(
        TOKENS, 1, spec.hidden_size, requires_grad=True, generator=torch.Generator().manual_seed(0)
    )
    got = _saved_bytes(mlp, frozen, x)
    # the layer's input is the linear's input after the norm, counted with the norms
    planned = TOKENS * spec.hidden_size * 4 + moe_bytes(spec, 1, None, TOKENS, 4)
    assert got == pytest.approx(planned, rel=0.01), (got, planned)


def test_a_real_moe_keeps_about_twice_a_dense_mlp_of_its_ffn_width():
    spec = get_model_spec("qwen3-30b-a3b")  # 128 experts, 8 per token, 768 wide; ffn 6144
    dense = TOKENS * 4 * spec.ffn_hidden_size * 2
    assert moe_bytes(spec, 1, None, TOKENS, 2) / dense > 1.7
    # expert tensor parallelism divides only the experts' own tensors
    assert moe_bytes(spec, 1, 2, TOKENS, 2) < moe_bytes(spec, 1, None, TOKENS, 2)
