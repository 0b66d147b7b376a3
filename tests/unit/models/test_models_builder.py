"""Megatron models built from ModelSpecs: parameter names, shapes, roles, HF logits parity at 1-1-1."""

import json

import pytest
import torch

from rl3d.models.builder import (
    build_gpt,
    global_layer_index,
    local_layer_index,
    megatron_param_kinds,
    stage_param_names,
)
from rl3d.models.hf_mapping import spec_from_hf_config, tensor_maps
from rl3d.models.spec import get_model_spec
from rl3d.models.weights import load_weights
from rl3d.ops.layouts import ShardKind, padded_vocab_size


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-odd-vocab"])
def test_param_kinds_are_the_real_megatron_names(groups_1x1, name):
    spec = get_model_spec(name)
    model = build_gpt(spec, groups_1x1)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    kinds = megatron_param_kinds(spec)
    assert list(kinds) == list(real)  # same names, same order
    padded = padded_vocab_size(spec.vocab_size, 1)
    for tmap in tensor_maps(spec, padded):
        assert tmap.shape == real[tmap.mcore], tmap.mcore


def test_param_kinds_llama():
    kinds = megatron_param_kinds(get_model_spec("tiny-llama"))
    assert kinds["embedding.word_embeddings.weight"] is ShardKind.VOCAB
    assert kinds["decoder.layers.1.self_attention.linear_qkv.weight"] is ShardKind.QKV
    assert kinds["decoder.layers.1.self_attention.linear_proj.weight"] is ShardKind.ROW
    assert kinds["decoder.layers.0.mlp.linear_fc1.weight"] is ShardKind.SWIGLU_FC1
    assert kinds["decoder.layers.0.mlp.linear_fc2.weight"] is ShardKind.ROW
    assert kinds["decoder.final_layernorm.weight"] is ShardKind.REPLICATED
    assert kinds["output_layer.weight"] is ShardKind.VOCAB
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in kinds


def test_param_kinds_qwen2_tied_with_bias():
    spec = get_model_spec("tiny-qwen2")
    kinds = megatron_param_kinds(spec)
    assert kinds["decoder.layers.0.self_attention.linear_qkv.bias"] is ShardKind.QKV
    assert "output_layer.weight" not in kinds  # tied: the embedding is the only copy
    assert megatron_param_kinds(spec, role="critic")["output_layer.weight"] is ShardKind.REPLICATED


def test_layer_index_mapping():
    spec = get_model_spec("llama2-7b")  # 32 layers
    assert global_layer_index(spec, 4, 2, 3) == 19
    assert local_layer_index(spec, 4, 19) == (2, 3)
    with pytest.raises(ValueError, match="do not split"):
        global_layer_index(spec, 3, 0, 0)


def test_stage_param_names_split_layers():
    spec = get_model_spec("tiny-llama")
    first = stage_param_names(spec, 2, 0)
    last = stage_param_names(spec, 2, 1)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"] == "decoder.layers.0.mlp.linear_fc1.weight"
    assert last["decoder.layers.1.mlp.linear_fc1.weight"] == "decoder.layers.0.mlp.linear_fc1.weight"
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert set(first) | set(last) == set(megatron_param_kinds(spec))


def _ids(spec, batch=2, seq=11, seed=3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, seq), generator=gen)
    return ids, torch.arange(seq).expand(batch, seq)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_logits_match_hf_at_1x1(groups_1x1, tiny_hf_dirs, name):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_hf_dirs[name]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    model = build_gpt(spec, groups_1x1)
    load_weights(model, spec, groups_1x1, hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids, pos = _ids(spec)
    with torch.no_grad():
        ours = model(ids, pos, None)[..., : spec.vocab_size]
        ref = hf(ids).logits
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-5, diff


def test_critic_value_head(groups_1x1, tiny_hf_dirs):
    hf_dir = tiny_hf_dirs["tiny-qwen2"]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    critic = build_gpt(spec, groups_1x1, role="critic", seed=5)
    load_weights(critic, spec, groups_1x1, hf_dir, role="critic")
    head = critic.output_layer.weight.detach().clone()
    assert head.shape == (1, spec.hidden_size)
    assert torch.equal(head, build_gpt(spec, groups_1x1, role="critic", seed=5).output_layer.weight)
    ids, pos = _ids(spec)
    values = critic(ids, pos, None)
    assert values.shape == (2, 11, 1)
    values.sum().backward()
    assert critic.output_layer.weight.grad is not None
    assert critic.embedding.word_embeddings.weight.grad is not None


def test_reference_has_no_grads(groups_1x1):
    ref = build_gpt(get_model_spec("tiny-llama"), groups_1x1, role="reference")
    assert not any(p.requires_grad for p in ref.parameters())
    assert not ref.training


def test_unknown_role(groups_1x1):
    with pytest.raises(ValueError, match="role must be one of"):
        build_gpt(get_model_spec("tiny-llama"), groups_1x1, role="judge")


def test_bootstrap_checks_world_and_double_init(groups_1x1):
    from rl3d.models.bootstrap import init_megatron
    from rl3d.parallel.layout import ParallelLayout

    assert (groups_1x1.tp_rank, groups_1x1.pp_rank, groups_1x1.dp_rank) == (0, 0, 0)
    assert groups_1x1.is_first_stage and groups_1x1.is_last_stage
    with pytest.raises(ValueError, match="needs 2 ranks, world has 1"):
        init_megatron(ParallelLayout(1, 2, 1))
    with pytest.raises(RuntimeError, match="already initialised"):
        init_megatron(ParallelLayout(1, 1, 1))
