"""With Transformer Engine's layer spec a layer's norms live in the next linear
(`...linear_qkv.layer_norm_weight`, `...linear_fc1.layer_norm_weight`). A local-spec model renamed
that way goes through the resharder's `global_shards`, saving and loading like the local one."""

import torch

from rl3d.engine import MegatronEngine
from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.spec import get_model_spec
from rl3d.models.weights import load_weights, save_weights


def te_named(role: MegatronEngine) -> MegatronEngine:
    for layer in role.model.decoder.layers:
        for norm, linear in (
            ("input_layernorm", "self_attention.linear_qkv"),
            ("pre_mlp_layernorm", "mlp.linear_fc1"),
        ):
            weight = getattr(layer, norm).weight
            setattr(layer, norm, torch.nn.Identity())
            layer.get_submodule(linear).register_parameter("layer_norm_weight", weight)
    return role


def make_role(groups, seed):
    spec = get_model_spec("tiny-llama")
    return MegatronEngine(spec, groups, role="actor", params_dtype=torch.float32, seed=seed)


def test_te_names_through_global_shards_save_and_load(groups_1x1, tmp_path):
    plain, te = make_role(groups_1x1, seed=3), te_named(make_role(groups_1x1, seed=3))
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in te.model.named_parameters())
    te_shards = te.global_shards()
    assert sorted(plain.global_shards()) == sorted(te_shards)  # the planner's names either way
    norm = "decoder.layers.0.input_layernorm.weight"
    te_param = te.model.decoder.layers[0].self_attention.linear_qkv.layer_norm_weight
    assert te_shards[norm].data_ptr() == te_param.data_ptr()  # the trained tensor itself, no copy

    with torch.no_grad():
        te_param.mul_(2.0)  # a TE model that trained away from the plain one
    spec = plain.spec
    save_weights(te.model, spec, groups_1x1, tmp_path / "w", hf_config=hf_config_from_spec(spec).to_dict())
    for target in (make_role(groups_1x1, seed=9), te_named(make_role(groups_1x1, seed=9))):
        load_weights(target.model, spec, groups_1x1, tmp_path / "w")
        loaded = target.global_shards()
        assert all(torch.equal(loaded[n], te.global_shards()[n]) for n in loaded)
