"""DeepSeek-V3 (`model_type: deepseek_v3`) from its config.json: the registry shapes, the
parameter counts against the published totals, and the refusals by key."""

import pytest

from rl3d.models.hf_mapping import hf_config_from_spec, spec_from_hf_config
from rl3d.models.spec import get_model_spec, hf_model_type

# The published DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), its YaRN RoPE and FP8
# quantization taken out (both refused below).
DEEPSEEK_V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
YARN = {
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }
}
FP8 = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}}


def test_spec_from_the_hub_config_is_the_registrys():
    """The hub's config.json gives the registry's shape (the registry keeps YaRN's original 4096
    positions); the MTP module (num_nextn_predict_layers) is read past, not held."""
    from dataclasses import replace

    found = spec_from_hf_config(DEEPSEEK_V3_HUB, name="deepseek-v3")
    assert replace(found, max_position_embeddings=4096) == get_model_spec("deepseek-v3")
    spec = get_model_spec("deepseek-v3")
    assert (spec.is_mla, spec.head_dim, spec.rotary_dim, spec.moe_first_dense_layers) == (True, 192, 64, 3)
    assert (spec.moe_router_groups, spec.moe_router_group_topk, hf_model_type(spec)) == (8, 4, "deepseek_v3")


def test_tiny_spec_round_trips_through_its_transformers_config():
    spec = get_model_spec("tiny-deepseek-v3")
    config = hf_config_from_spec(spec).to_dict()
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 0
    assert spec_from_hf_config(config, name="tiny-deepseek-v3") == spec


def test_deepseek_v3_counts_the_published_totals():
    """DeepSeek-V3 "671B total, 37B activated" (the model card; the hub's 685B adds the 14B MTP
    module). Counted: the main model's HF tensors (`num_params`, the routers' correction biases
    included, the MTP module not): 671.026e9, +0.004%. Active, with the embedding and output
    layer (DeepSeek's count): 37.55e9, +1.5% (35.70e9 without them, `active_params`)."""
    spec = get_model_spec("deepseek-v3")
    assert spec.num_params() == 671_026_419_200
    assert abs(spec.num_params() - 671e9) / 671e9 < 0.001
    with_embeddings = spec.active_params() + 2 * spec.vocab_size * spec.hidden_size
    assert abs(with_embeddings - 37e9) / 37e9 < 0.02, with_embeddings
    assert spec.active_params() == 35_698_939_392


@pytest.mark.parametrize(
    "change, refusal",
    [
        (YARN, "rope type 'yarn' is not supported"),
        (FP8, "deepseek_v3: quantization_config is not supported"),
        ({"topk_group": 2}, "num_experts_per_tok 8 with topk_group 2 is not supported"),
        ({"norm_topk_prob": False}, "deepseek_v3: norm_topk_prob false is not supported"),
        ({"rope_interleave": False}, "deepseek_v3: rope_interleave false is not supported"),
        ({"attention_bias": True}, "deepseek_v3: attention_bias true is not supported"),
        ({"topk_method": "greedy"}, "deepseek_v3: topk_method 'greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
        ({"hidden_act": "gelu"}, "deepseek_v3: hidden_act 'gelu' is not supported"),
        ({"num_key_value_heads": 8}, "num_key_value_heads 8 != 128 heads"),
        ({"qk_rope_head_dim": 63}, "MLA needs an even qk_rope_head_dim"),
        ({"n_group": 6}, "256 experts in 6 groups"),
    ],
)
def test_refuses_what_rl3d_cannot_run_by_key(change, refusal):
    with pytest.raises(ValueError, match=refusal):
        spec_from_hf_config({**DEEPSEEK_V3_HUB, **change})
