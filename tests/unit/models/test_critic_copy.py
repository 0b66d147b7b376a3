"""A colocated critic starts from the actor's network by global name: with the actor on
Transformer Engine's layer spec (its norms fused into the next linear, as a packing actor on a GPU
has) and the critic on the local spec (padded batches), every parameter but the value head is
the actor's, norms included; a parameter nothing reaches is an error naming it."""

import pytest
import torch
from test_models_te_names import te_named

from rl3d.engine import InitialWeights, MegatronEngine
from rl3d.models.params import OUTPUT_LAYER
from rl3d.models.spec import get_model_spec

SPEC = get_model_spec("tiny-llama")


def role(groups, name, init_from=None):
    weights = InitialWeights(copy_of=init_from)
    return MegatronEngine(SPEC, groups, role=name, params_dtype=torch.float32, seed=11, weights=weights)


def trained_actor(groups):
    actor = te_named(role(groups, "actor"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # every tensor away from its initial value, the norms from 1.0
        for t in actor.global_shards().values():
            t.add_(torch.rand(t.shape, generator=gen))
    return actor


def test_the_critic_copies_every_actor_tensor_by_global_name(groups_1x1):
    actor = trained_actor(groups_1x1)
    critic = role(groups_1x1, "critic", init_from=actor)
    assert not any("layer_norm_weight" in n for n, _ in critic.model.named_parameters())  # local spec
    theirs, mine = actor.global_shards(), critic.global_shards()
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        if name != OUTPUT_LAYER:
            assert torch.equal(mine[name], theirs[name]), name
    assert mine[OUTPUT_LAYER].shape == (1, SPEC.hidden_size)  # its own value head
    reference = role(groups_1x1, "reference", init_from=actor)
    assert all(torch.equal(t, theirs[n]) for n, t in reference.global_shards().items())


def test_an_unreachable_parameter_is_named(groups_1x1):
    actor = trained_actor(groups_1x1)
    del actor.model.decoder.layers[1].mlp.linear_fc1._parameters["layer_norm_weight"]
    with pytest.raises(
        RuntimeError, match=r"critic from actor: .*decoder\.layers\.1\.pre_mlp_layernorm\.weight"
    ):
        role(groups_1x1, "critic", init_from=actor)
