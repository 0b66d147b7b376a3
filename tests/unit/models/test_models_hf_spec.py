"""A run's model spec from its HF directory (`spec_of`), and a dist checkpoint exported to HF
in one process (`rl3d.models.export`)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rl3d.config import ModelConfig
from rl3d.config.errors import ConfigError
from rl3d.models.hf_mapping import hf_config_from_spec, spec_from_hf_config
from rl3d.models.spec import MODEL_SPECS, get_model_spec, spec_of

GRPO = str(Path(__file__).resolve().parents[3] / "recipes/quickstart_cpu_grpo.yaml")


def write_config(directory, **config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def own_qwen2(**overrides):
    """A Qwen2 config whose shapes are in no registry: GQA 6/2, untied, theta 5e5, eps 1e-6."""
    config = dict(
        model_type="qwen2",
        vocab_size=200,
        hidden_size=48,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=5e5,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    return {**config, **overrides}


def model(name=None, hf_path=None):
    return SimpleNamespace(name=name, hf_path=None if hf_path is None else str(hf_path))


def test_shapes_come_from_the_hf_directory_when_the_name_is_unset(tmp_path):
    hf = write_config(tmp_path / "mine", **own_qwen2())
    spec = spec_of(model(hf_path=hf))
    assert spec.name == str(hf)
    assert (spec.num_layers, spec.hidden_size, spec.ffn_hidden_size) == (2, 48, 136)
    assert (spec.num_attention_heads, spec.num_query_groups, spec.vocab_size) == (6, 2, 200)
    assert spec.qkv_bias and not spec.tied_embeddings
    assert (spec.rope_theta, spec.norm_eps, spec.max_position_embeddings) == (5e5, 1e-6, 128)
    assert all(spec != s for s in MODEL_SPECS.values())


def test_a_known_name_must_agree_naming_both_and_every_differing_field(tmp_path):
    agrees = write_config(tmp_path / "q", **hf_config_from_spec(get_model_spec("tiny-qwen2")).to_dict())
    assert spec_of(model("tiny-qwen2", agrees)) == get_model_spec("tiny-qwen2")
    other = write_config(tmp_path / "other", **own_qwen2())
    with pytest.raises(ValueError) as err:
        spec_of(model("tiny-qwen2", other))
    message = str(err.value)
    assert str(other / "config.json") in message and "model.name 'tiny-qwen2'" in message
    for field in ("hidden_size=48", "hidden_size=64", "rope_theta=500000.0", "tied_embeddings=False"):
        assert field in message, message
    assert "num_layers" not in message  # both have 2 layers


def test_the_smaller_position_limit_wins_and_a_missing_directory_is_left_to_the_preflight(tmp_path):
    config = {**hf_config_from_spec(get_model_spec("tiny-llama")).to_dict(), "max_position_embeddings": 64}
    short = write_config(tmp_path / "short", **config)
    assert spec_of(model("tiny-llama", short)).max_position_embeddings == 64
    assert spec_of(model("tiny-llama", tmp_path / "absent")) == get_model_spec("tiny-llama")
    with pytest.raises(ValueError, match="no config.json"):
        spec_of(model(hf_path=tmp_path / "absent"))


@pytest.mark.parametrize("window, positions", [(None, 32768), (4096, 4096)])
def test_mistral_is_a_llama_layout_with_full_attention_up_to_its_window(window, positions):
    config = dict(
        model_type="mistral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=window,
        max_position_embeddings=32768,
    )
    spec = spec_from_hf_config(config)
    assert spec.num_query_groups == 8 and not spec.qkv_bias and not spec.tied_embeddings
    assert spec.max_position_embeddings == positions


def test_model_config_needs_a_name_or_an_hf_path():
    assert ModelConfig(hf_path="/somewhere").name is None
    with pytest.raises(ValueError, match="name: missing required key"):
        ModelConfig()


def test_a_recipe_without_a_name_takes_the_shapes_from_hf_path(tmp_path):
    from rl3d.config import load_config

    hf = write_config(tmp_path / "mine", **own_qwen2())
    recipe = GRPO
    cfg = load_config(recipe, ["model.name=null", f"model.hf_path={hf}"]).config
    assert cfg.model.name is None and spec_of(cfg.model).hidden_size == 48
    odd = write_config(tmp_path / "odd", **own_qwen2(num_key_value_heads=3))  # tp=2 cannot split 3
    with pytest.raises(ConfigError, match="tp=2 must divide the model's 3 KV heads"):
        load_config(recipe, ["model.name=null", f"model.hf_path={odd}"])
    with pytest.raises(ConfigError, match="model.hf_path.*holds a model with"):
        load_config(recipe, [f"model.hf_path={hf}"])  # the recipe's tiny-llama is another model


def test_dist_checkpoint_exports_to_the_hf_tensors_bit_for_bit(groups_1x1, tiny_hf_dirs, tmp_path):
    """A megatron dist checkpoint of a model loaded from HF is read back without process groups
    and written as the same HF tensors; config and other files come from the source."""
    from rl3d.models.builder import build_gpt
    from rl3d.models.dist_checkpoint import save_checkpoint
    from rl3d.models.export import export_hf
    from rl3d.models.weights import load_weights

    for name in ("tiny-llama", "tiny-qwen2"):  # untied, and tied with QKV bias
        src = tiny_hf_dirs[name]
        spec = spec_of(model(hf_path=src))
        gpt = build_gpt(spec, groups_1x1)
        load_weights(gpt, spec, groups_1x1, src)
        save_checkpoint(
            tmp_path / name / "ckpt", ddp=gpt, optimizer=None, scheduler=None, groups=groups_1x1, iteration=0
        )
        out = export_hf(tmp_path / name / "ckpt", spec, tmp_path / name / "hf", source=src)
        ours, theirs = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
        assert sorted(ours) == sorted(theirs)
        for key, tensor in theirs.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
        assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
        assert json.loads((out / "config.json").read_text())["model_type"] == spec_from_hf_config(
            json.loads((src / "config.json").read_text())
        ).name.removeprefix("hf-")
        assert not list(out.parent.glob(".hf.tmp-*"))


def test_an_rl3d_megatron_directory_gives_its_recorded_spec(tiny_hf_dirs, tmp_path):
    from dataclasses import replace

    from rl3d.models.convert import hf_to_mcore

    src = tiny_hf_dirs["tiny-qwen2"]
    hf_to_mcore(src, tmp_path / "m", tp=2, pp=1)
    spec = spec_of(model(hf_path=tmp_path / "m"))
    assert spec == replace(spec_of(model(hf_path=src)), name=str(tmp_path / "m"))
    assert spec_of(model("tiny-qwen2", tmp_path / "m")) == get_model_spec("tiny-qwen2")


def test_moe_shapes_count_published_totals():
    """Qwen3-30B-A3B and 235B-A22B: the parameter counts their names state, total and active."""
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235.1e9, 22.1e9)):
        spec = get_model_spec(name)
        h, hd = spec.hidden_size, spec.head_dim
        attention = (2 * spec.num_attention_heads + 2 * spec.num_query_groups) * hd * h
        used = spec.num_layers * (attention + spec.active_mlp_params()) + 2 * spec.vocab_size * h
        assert spec.is_moe and hd * spec.num_attention_heads != h
        assert abs(spec.num_params() - total) / total < 0.01, name
        assert abs(used - active) / active < 0.03, name


# GLM-4.5's published config.json (zai-org/GLM-4.5; -Air differs where `AIR` says)
GLM45_HUB = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 151552,
}
AIR = dict(
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    num_hidden_layers=46,
    use_qk_norm=False,
)


def test_glm_specs_from_the_hub_configs():
    """GLM-4.5's and GLM-4.5-Air's config.json give the registry's shapes; the MTP layer
    (num_nextn_predict_layers) is read past, not held."""
    assert spec_from_hf_config(GLM45_HUB, name="glm-4.5") == get_model_spec("glm-4.5")
    assert spec_from_hf_config({**GLM45_HUB, **AIR}, name="glm-4.5-air") == get_model_spec("glm-4.5-air")
    glm = get_model_spec("glm-4.5")
    assert (glm.moe_first_dense_layers, glm.num_moe_layers, glm.rotary_dim) == (3, 89, 64)
    assert glm.qkv_bias and glm.qk_norm and not glm.shared_expert_gate and glm.moe_expert_bias


def test_glm_shapes_count_published_totals():
    """GLM-4.5 "355B total / 32B active" and GLM-4.5-Air "106B / 12B" (the model cards).

    Counted: the main model's HF tensors (`num_params`), the router's correction bias included,
    the MTP layer not (it adds 3.99e9 to GLM-4.5 and 2.38e9 to Air, with its copies of the
    embedding and output layer 5.54e9 and 3.62e9: the hub's 358B). Totals within 1% (measured
    352.80e9: -0.62%; 106.85e9: +0.80%). Active: what one token uses without the embedding and
    output layer (`active_params`: attention, norms, dense MLPs, 8 routed experts, the shared
    expert and the router), within 2% (measured 32.08e9: +0.25%; 12.18e9: +1.5%)."""
    for name, total, active in (("glm-4.5", 355e9, 32e9), ("glm-4.5-air", 106e9, 12e9)):
        spec = get_model_spec(name)
        assert abs(spec.num_params() - total) / total < 0.01, (name, spec.num_params())
        assert abs(spec.active_params() - active) / active < 0.02, (name, spec.active_params())
    assert get_model_spec("glm-4.5").num_params() == 352_797_829_024


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"n_group": 4, "topk_group": 2}, "glm4_moe: n_group 4 / topk_group 2 are not supported"),
        ({"norm_topk_prob": False}, "glm4_moe: norm_topk_prob false is not supported"),
        ({"hidden_act": "gelu"}, "glm4_moe: hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "glm4_moe: mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"first_k_dense_replace": 92}, "moe_first_dense_layers 92 must leave a mixture-of-experts layer"),
        ({"partial_rotary_factor": 0.3}, "rotary_fraction 0.3 of head width 128"),
    ],
)
def test_glm_refuses_what_rl3d_cannot_run_by_key(change, refusal):
    with pytest.raises(ValueError, match=refusal):
        spec_from_hf_config({**GLM45_HUB, **change})
