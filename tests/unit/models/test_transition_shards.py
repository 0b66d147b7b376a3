"""A bf16 actor's transition moves bf16 tensors: megatron's local spec (no Transformer Engine,
no apex) keeps the norms of a bf16 model in fp32, which the 3D-HybridEngine refused, so a bf16
run without TE died at its first reshard. `transition_shards` casts those few and hands the rest
over as the training tensors themselves."""

import torch

from rl3d.config import OptimConfig
from rl3d.engine import InitialWeights, MegatronEngine, Training
from rl3d.models.spec import get_model_spec


def make_role(groups, hf_dirs, dtype):
    return MegatronEngine(
        get_model_spec("tiny-llama"),
        groups,
        role="actor",
        params_dtype=dtype,
        seed=3,
        training=Training(OptimConfig(lr=1e-2)),
        weights=InitialWeights(hf_path=hf_dirs["tiny-llama"]),
    )


def test_a_bf16_model_moves_in_bf16_and_its_other_tensors_are_the_training_ones(groups_1x1, tiny_hf_dirs):
    role = make_role(groups_1x1, tiny_hf_dirs, torch.bfloat16)
    train, moved = role.global_shards(), role.transition_shards()
    kept_fp32 = {name for name, t in train.items() if t.dtype == torch.float32}
    assert kept_fp32 and all("norm" in name for name in kept_fp32)  # what megatron does here
    assert moved.keys() == train.keys() and all(t.dtype == torch.bfloat16 for t in moved.values())
    for name, t in moved.items():
        if name in kept_fp32:
            assert torch.equal(t, train[name].to(torch.bfloat16))
        else:
            assert t.data_ptr() == train[name].data_ptr()  # no copy


def test_an_fp32_model_moves_its_training_tensors_themselves(groups_1x1, tiny_hf_dirs):
    role = make_role(groups_1x1, tiny_hf_dirs, torch.float32)
    train, moved = role.global_shards(), role.transition_shards()
    assert all(moved[name].data_ptr() == t.data_ptr() for name, t in train.items())
