"""SeededFullModel: the benchmark's full model, made one tensor at a time."""

import torch

from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import SeededFullModel, training_shards, zero_shards
from rl3d.models.spec import get_model_spec


def test_each_tensor_is_deterministic_and_shards_match_the_materialized_model():
    spec = get_model_spec("tiny-qwen2")
    params = model_params(spec, train_tp=2)
    lazy = SeededFullModel(params, seed=5, dtype=torch.bfloat16)
    eager = {name: lazy[name] for name in lazy}  # what full_model would hold in memory
    assert len(lazy) == len(params) and list(lazy) == [p.name for p in params]
    name = params[3].name
    assert torch.equal(lazy[name], SeededFullModel(params, seed=5, dtype=torch.bfloat16)[name])
    assert not torch.equal(lazy[name], SeededFullModel(params, seed=6, dtype=torch.bfloat16)[name])
    assert lazy[name].dtype == torch.bfloat16 and lazy[name].shape == params[3].shape
    kwargs = dict(pp_rank=1, pp=2, tp_rank=1, tp=2, num_layers=spec.num_layers)
    from_lazy, from_eager = training_shards(lazy, params, **kwargs), training_shards(eager, params, **kwargs)
    assert from_lazy.keys() == from_eager.keys()
    assert all(torch.equal(from_lazy[k], from_eager[k]) for k in from_lazy)
    z_lazy, z_eager = zero_shards(lazy, params, rank=1, world=4), zero_shards(eager, params, rank=1, world=4)
    assert all(torch.equal(z_lazy[k], z_eager[k]) for k in z_lazy)
