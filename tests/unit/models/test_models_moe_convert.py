"""HF <-> Megatron conversion of Qwen3, Qwen3-MoE, Qwen2-MoE, GLM-4.5 and DeepSeek-V3 at several TP x PP x EP:
bit for bit round trips, expert files, and the config checks."""

import json

import pytest
import torch

from rl3d.models.cli_convert import main
from rl3d.models.convert import McoreReader, hf_to_mcore, mcore_to_hf, shard_dir_name
from rl3d.models.hf_mapping import hf_config_from_spec, spec_from_hf_config
from rl3d.models.safetensors_io import ShardedReader
from rl3d.models.spec import get_model_spec


def _tensors(directory):
    with ShardedReader(directory) as reader:
        return {name: reader.get(name) for name in reader.weight_map}


LAYOUTS = {  # (tp, pp, ep)
    "tiny-qwen3": [(1, 1, 1), (2, 2, 1)],
    "tiny-qwen3-moe": [(1, 1, 1), (1, 1, 2), (2, 1, 4), (2, 2, 2), (1, 2, 8)],
    "tiny-qwen2-moe": [(1, 1, 1), (2, 1, 2), (2, 2, 4)],
    "tiny-glm4-moe": [(1, 1, 1), (2, 1, 2), (2, 2, 4), (1, 4, 8)],  # pp 4: the dense layer alone
    "tiny-deepseek-v3": [(1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 2, 4), (1, 4, 16)],  # MLA's column shards
}
CASES = [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{t}x{p}x{e}" for n, (t, p, e) in CASES])
def test_round_trip_bit_for_bit(tiny_moe_hf_dirs, tmp_path, name, layout):
    tp, pp, ep = layout
    src = tiny_moe_hf_dirs[name]
    meta = hf_to_mcore(src, tmp_path / "mcore", tp=tp, pp=pp, ep=ep)
    assert (meta.tp, meta.pp, meta.ep) == layout
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    before, after = _tensors(src), _tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def test_an_ep_rank_file_holds_its_experts_and_the_dense_weights(tiny_moe_hf_dirs, tmp_path):
    src = tiny_moe_hf_dirs["tiny-qwen3-moe"]  # 8 experts of width 32, 2 layers
    hf_to_mcore(src, tmp_path / "m", tp=2, pp=2, ep=4)
    rank = _tensors(tmp_path / "m" / shard_dir_name(1, 1, 3))  # tp 1, stage 1 (layer 1), EP rank 3
    experts = sorted(k for k in rank if ".experts." in k)
    assert experts == [
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in (0, 1) for i in (1, 2)
    ]
    with ShardedReader(src) as hf:  # local expert 1 of EP rank 3 is global expert 7; TP half of fc2
        down = hf.get("model.layers.1.mlp.experts.7.down_proj.weight")
    assert torch.equal(rank["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"], down[:, 16:])
    assert rank["decoder.layers.0.mlp.router.weight"].shape == (8, 64)
    assert rank["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (32,)
    hf_to_mcore(src, tmp_path / "one", tp=1, pp=1, ep=1)
    with McoreReader(tmp_path / "m") as m, McoreReader(tmp_path / "one") as one:
        for name in (
            "decoder.layers.1.mlp.experts.local_experts.6.linear_fc1.weight",
            "decoder.layers.1.mlp.router.weight",
        ):
            assert torch.equal(m.full(name), one.full(name))
            assert torch.equal(m.shard(name, 1, 0, 256), one.full(name))


def test_cli_ep_and_layout_errors(tiny_moe_hf_dirs, tiny_hf_dirs, tmp_path, capsys):
    src = tiny_moe_hf_dirs["tiny-qwen2-moe"]
    args = ["hf2mcore", "--src", str(src), "--dst", str(tmp_path / "m"), "--tp", "2", "--ep", "2"]
    assert main(args) == 0
    assert "qwen2_moe as tp=2 pp=1 ep=2" in capsys.readouterr().out
    assert main(["mcore2hf", "--src", str(tmp_path / "m"), "--dst", str(tmp_path / "h")]) == 0
    assert main([*args[:4], str(tmp_path / "x"), "--ep", "3"]) == 2
    assert "ep=3 must divide the number of experts (8)" in capsys.readouterr().err
    dense = ["hf2mcore", "--src", str(tiny_hf_dirs["tiny-llama"]), "--dst", str(tmp_path / "d"), "--ep", "2"]
    assert main(dense) == 2
    assert "is dense (no experts to split)" in capsys.readouterr().err


def _config(name, **overrides):
    return {**hf_config_from_spec(get_model_spec(name)).to_dict(), **overrides}


def test_spec_from_hf_config_refuses_dense_layers_in_a_moe():
    with pytest.raises(ValueError, match="qwen3_moe: decoder_sparse_step 2 is not supported"):
        spec_from_hf_config(_config("tiny-qwen3-moe", decoder_sparse_step=2))
    with pytest.raises(ValueError, match=r"qwen2_moe: mlp_only_layers \[0\] is not supported"):
        spec_from_hf_config(_config("tiny-qwen2-moe", mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="qwen3: mlp_bias / attention_bias"):
        spec_from_hf_config(_config("tiny-qwen3", attention_bias=True))


def test_spec_from_a_hub_style_config():
    """The published Qwen3-30B-A3B config.json's fields give the registry's shape."""
    hub = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
    }
    spec = spec_from_hf_config(hub, name="qwen3-30b-a3b")
    assert spec == get_model_spec("qwen3-30b-a3b")
    assert json.dumps(hub)  # plain JSON, as read from the hub
