"""`MegatronEngine.from_config`, the one place a role is built from recipe sections: the dtype
from `model.dtype`, packing and its token budget from the role's section, the optimizer from
`optim`, and the constructor's network."""

import pytest
import torch

from rl3d.config import ActorConfig, ModelConfig, OptimConfig, ReferenceConfig
from rl3d.config.reward_model import RewardModelConfig
from rl3d.engine import MegatronEngine
from rl3d.engine.techniques import Packing
from rl3d.models.spec import get_model_spec

SPEC = get_model_spec("tiny-llama")


def max_tokens(role):
    """The role's packing token budget (None without packing, or packing by sequence count)."""
    packing = role.features.get(Packing)
    return None if packing is None else packing.max_tokens


def test_trained_role_takes_its_sections(groups_1x1):
    section = ActorConfig(packing=True, max_tokens_per_micro_batch=64, optim=OptimConfig(lr=3e-4))
    role = MegatronEngine.from_config(
        SPEC,
        groups_1x1,
        role="actor",
        model=ModelConfig(name="tiny-llama", dtype="bfloat16"),
        seed=5,
        batching=section,
        optim=section.optim,
        total_steps=4,
    )
    assert (role.packing, max_tokens(role), role.trainable) == (True, 64, True)
    assert role.model.embedding.word_embeddings.weight.dtype == torch.bfloat16  # model.dtype
    assert role.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "batching, packed",
    [
        (None, (False, None)),
        (ReferenceConfig(), (False, None)),
        (RewardModelConfig(path="rm", packing=True), (True, None)),
    ],
)
def test_forward_only_roles(groups_1x1, batching, packed):
    model = ModelConfig(name="tiny-llama", dtype="float32")
    role = MegatronEngine.from_config(SPEC, groups_1x1, role="critic", model=model, seed=1, batching=batching)
    assert (role.packing, max_tokens(role)) == packed
    assert not role.trainable and role.optimizer is None


def test_same_network_as_the_constructor(groups_1x1):
    """Same parameters (names, shapes, dtypes) as the constructor given the same values; the
    values themselves come from megatron's global generator, not from `seed`."""
    model = ModelConfig(name="tiny-llama", dtype="float32")
    built = MegatronEngine.from_config(SPEC, groups_1x1, role="actor", model=model, seed=7)
    direct = MegatronEngine(SPEC, groups_1x1, role="actor", params_dtype=torch.float32, seed=7)

    def inventory(role):
        return {name: (t.shape, t.dtype) for name, t in role.global_shards().items()}

    assert inventory(built) == inventory(direct)
    assert (built.packing, max_tokens(built), built.trainable) == (direct.packing, max_tokens(direct), False)


def test_budget_without_packing_names_the_key(groups_1x1):
    class Section:  # a section that skipped its own validation
        packing, max_tokens_per_micro_batch = False, 32

    model = ModelConfig(name="tiny-llama", dtype="float32")
    with pytest.raises(ValueError, match="reference.max_tokens_per_micro_batch needs reference.packing"):
        MegatronEngine.from_config(
            SPEC, groups_1x1, role="reference", model=model, seed=1, batching=Section()
        )
