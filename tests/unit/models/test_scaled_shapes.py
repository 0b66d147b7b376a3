"""`BASE-shape-1/K`: the scaled-down shapes the measured benchmarks use keep a model's layer
proportions, a mixture of experts' included."""

import pytest

from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec


def _numel(name: str) -> int:
    return sum(p.numel for p in model_params(get_model_spec(name), train_tp=1))


@pytest.mark.parametrize("base", ["llama3-8b", "qwen3-30b-a3b", "glm-4.5-air"])
def test_every_width_is_divided_and_the_layers_kept(base):
    full, scaled = get_model_spec(base), get_model_spec(f"{base}-shape-1/16")
    assert scaled.num_layers == full.num_layers and scaled.num_experts == full.num_experts
    assert scaled.hidden_size * 16 == full.hidden_size and scaled.ffn_hidden_size * 16 == full.ffn_hidden_size
    assert scaled.moe_ffn_hidden_size * 16 == full.moe_ffn_hidden_size
    assert scaled.shared_expert_ffn_hidden_size * 16 == full.shared_expert_ffn_hidden_size
    # a layer's matrices are hidden x width: 1/K of each makes about 1/K^2 of the parameters
    assert 0.5 < _numel(f"{base}-shape-1/16") * 16**2 / _numel(base) < 2.0
