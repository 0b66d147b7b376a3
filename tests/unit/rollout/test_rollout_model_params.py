"""The torch rollout engine needs exactly the inventory's parameters (`rl3d.models.params`)."""

import pytest
import torch

from rl3d.hybrid_engine.weights import full_model
from rl3d.models.params import megatron_params, model_params
from rl3d.models.spec import get_model_spec
from rl3d.rollout.model import ShardedWeights


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_rollout_needs_the_inventory(name):
    spec = get_model_spec(name)
    full = full_model(model_params(spec, train_tp=1), seed=0, dtype=torch.float32)
    needed = [p.name for p in megatron_params(spec)]
    weights = ShardedWeights.from_tensors(spec, {n: full[n] for n in needed})
    assert len(weights.layers) == spec.num_layers
    assert (weights.layers[0].qkv_bias[0] is not None) == spec.qkv_bias
    for missing in needed:
        with pytest.raises(ValueError, match="lack"):
            ShardedWeights.from_tensors(spec, {n: full[n] for n in needed if n != missing})
