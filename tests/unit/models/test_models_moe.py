"""Qwen3 (q/k norm), Qwen3-MoE, Qwen2-MoE and GLM-4.5: the parameter inventory against a built
megatron model, and megatron's logits against transformers' at 1-1-1."""

import json

import pytest
import torch
from safetensors import safe_open

from rl3d.models.builder import build_gpt, megatron_param_kinds, stage_param_names
from rl3d.models.hf_mapping import spec_from_hf_config, tensor_maps
from rl3d.models.params import megatron_params, model_tensors
from rl3d.models.spec import get_model_spec
from rl3d.models.weights import load_weights
from rl3d.ops.layouts import ShardKind, padded_vocab_size

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-glm4-moe", "tiny-deepseek-v3")


@pytest.mark.parametrize("name", FAMILIES)
def test_inventory_is_the_built_models_names_shapes_and_order(groups_1x1, name):
    spec = get_model_spec(name)
    real = {n: tuple(p.shape) for n, p in model_tensors(build_gpt(spec, groups_1x1)).items()}
    inventory = megatron_params(spec)
    assert [p.name for p in inventory] == list(real)
    assert all(p.shape == real[p.name] for p in inventory)
    padded = padded_vocab_size(spec.vocab_size, 1)
    assert [m.mcore for m in tensor_maps(spec, padded)] == list(real)


def test_moe_inventory_kinds_experts_and_hf_names():
    spec = get_model_spec("tiny-qwen2-moe")  # 8 experts of width 32, shared expert 48
    by_name = {p.name: p for p in megatron_params(spec)}
    fc1 = by_name["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert (fc1.kind, fc1.shape, fc1.expert) == (ShardKind.SWIGLU_FC1, (64, 64), 5)
    assert fc1.hf == (
        "model.layers.1.mlp.experts.5.gate_proj.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight",
    )
    fc2 = by_name["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert (fc2.kind, fc2.shape, fc2.hf) == (
        ShardKind.ROW,
        (64, 32),
        ("model.layers.1.mlp.experts.5.down_proj.weight",),
    )
    router = by_name["decoder.layers.0.mlp.router.weight"]
    assert (router.kind, router.shape, router.hf, router.expert) == (
        ShardKind.REPLICATED,
        (8, 64),
        ("model.layers.0.mlp.gate.weight",),
        None,
    )
    gate = by_name["decoder.layers.0.mlp.shared_experts.gate_weight"]
    assert (gate.kind, gate.shape, gate.hf) == (
        ShardKind.REPLICATED,
        (1, 64),
        ("model.layers.0.mlp.shared_expert_gate.weight",),
    )
    assert by_name["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (96, 64)
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in by_name
    assert sum(p.expert is not None for p in by_name.values()) == 2 * 8 * 2
    qwen3 = {p.name: p for p in megatron_params(get_model_spec("tiny-qwen3"))}
    q_norm = qwen3["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert (q_norm.kind, q_norm.shape, q_norm.hf) == (
        ShardKind.REPLICATED,
        (32,),
        ("model.layers.0.self_attn.q_norm.weight",),
    )
    assert qwen3["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 32, 64)


def test_hf_names_are_what_save_pretrained_writes(tiny_moe_hf_dirs):
    for name, hf_dir in tiny_moe_hf_dirs.items():
        with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
        spec = get_model_spec(name)
        ours = {n for p in megatron_params(spec) for n in p.hf}
        assert ours == stored, name


def test_ep_ranks_hold_their_experts_under_local_indices():
    spec = get_model_spec("tiny-qwen3-moe")  # 8 experts, 2 layers
    rank1 = stage_param_names(spec, 2, 1, ep=4, ep_rank=1)  # stage 1 holds global layer 1
    expert = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert rank1[expert.format(3)] == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert expert.format(2) in rank1 and expert.format(4) not in rank1 and expert.format(1) not in rank1
    assert rank1["decoder.layers.1.mlp.router.weight"] == "decoder.layers.0.mlp.router.weight"
    union = set()
    for pp_rank in range(2):
        for ep_rank in range(4):
            union |= set(stage_param_names(spec, 2, pp_rank, ep=4, ep_rank=ep_rank))
    assert union == set(megatron_param_kinds(spec))
    with pytest.raises(ValueError, match="8 experts do not split into ep=3"):
        stage_param_names(spec, 1, 0, ep=3, ep_rank=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers_at_1x1(groups_1x1, tiny_moe_hf_dirs, name):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_moe_hf_dirs[name]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    assert spec.qk_norm == ("qwen3" in name or "glm" in name) and spec.is_moe == (
        "moe" in name or "deepseek" in name
    )
    assert spec.is_mla == ("deepseek" in name)
    model = build_gpt(spec, groups_1x1)
    load_weights(model, spec, groups_1x1, hf_dir)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=gen)
    with torch.no_grad():
        ours = model(ids, torch.arange(13).expand(2, 13), None)[..., : spec.vocab_size]
        ref = hf(ids).logits
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-5, diff  # measured: tiny-glm4-moe 8.5e-7, tiny-deepseek-v3 5.4e-7


def test_dist_checkpoint_exports_to_the_hf_tensors_bit_for_bit(groups_1x1, tiny_moe_hf_dirs, tmp_path):
    """Experts sit in megatron's dist checkpoint stacked by layer and global expert index;
    the export reads each expert's slice back into the hub's per-expert tensors."""
    from safetensors.torch import load_file

    from rl3d.models.dist_checkpoint import save_checkpoint
    from rl3d.models.export import export_hf

    for name, src in tiny_moe_hf_dirs.items():
        spec = spec_from_hf_config(json.loads((src / "config.json").read_text()))
        gpt = build_gpt(spec, groups_1x1)
        load_weights(gpt, spec, groups_1x1, src)
        ckpt = tmp_path / name / "ckpt"
        save_checkpoint(ckpt, ddp=gpt, optimizer=None, scheduler=None, groups=groups_1x1, iteration=0)
        out = export_hf(ckpt, spec, tmp_path / name / "hf", source=src)
        ours, theirs = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
        assert sorted(ours) == sorted(theirs), name
        for key, tensor in theirs.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key


def _router_grad(groups, spec, hf_dir, **overrides):
    model = build_gpt(spec, groups, **overrides)
    load_weights(model, spec, groups, hf_dir)
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = model(ids, torch.arange(9).expand(2, 9), None)
    logits.float().logsumexp(-1).mean().backward()
    return model.decoder.layers[0].mlp.router.weight.grad.clone()


def test_router_losses_add_to_the_router_gradient_only_when_set(groups_1x1, tiny_moe_hf_dirs):
    spec = get_model_spec("tiny-qwen3-moe")
    hf_dir = tiny_moe_hf_dirs["tiny-qwen3-moe"]
    plain = _router_grad(groups_1x1, spec, hf_dir)
    assert torch.equal(plain, _router_grad(groups_1x1, spec, hf_dir))  # deterministic
    aux = _router_grad(groups_1x1, spec, hf_dir, moe_aux_loss_coeff=0.5)
    z = _router_grad(groups_1x1, spec, hf_dir, moe_z_loss_coeff=0.5)
    assert (aux - plain).abs().max() > 1e-4 and (z - plain).abs().max() > 1e-4


def test_glm_inventory_dense_first_layer_ungated_shared_expert_and_router_bias():
    spec = get_model_spec("tiny-glm4-moe")  # layer 0 dense (96 wide), layers 1-3: 8 experts of 32
    by_name = {p.name: p for p in megatron_params(spec)}
    assert by_name["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in by_name)
    bias = by_name["decoder.layers.1.mlp.router.expert_bias"]
    assert (bias.kind, bias.shape, bias.hf) == (
        ShardKind.REPLICATED,
        (8,),
        ("model.layers.1.mlp.gate.e_score_correction_bias",),
    )
    shared = by_name["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"]
    assert shared.hf == (
        "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight",
    )
    assert "decoder.layers.1.mlp.shared_experts.gate_weight" not in by_name
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in by_name
    assert padded_vocab_size(spec.vocab_size, 1) == spec.vocab_size  # so the counts agree
    assert sum(p.numel for p in by_name.values()) == spec.num_params()


def test_glm_router_bias_is_loaded_and_steers_the_routing(groups_1x1, tiny_moe_hf_dirs):
    """The HF correction bias arrives in megatron's router buffer (fp32), and zeroing it changes
    the logits: the test model's routing depends on it."""
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_moe_hf_dirs["tiny-glm4-moe"]
    spec = get_model_spec("tiny-glm4-moe")
    model = build_gpt(spec, groups_1x1)
    load_weights(model, spec, groups_1x1, hf_dir)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    router = model.decoder.layers[2].mlp.router
    assert router.expert_bias.dtype == torch.float32 and router.expert_bias.abs().max() > 0
    assert torch.equal(router.expert_bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    position = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        biased = model(ids, position, None)
        for layer in model.decoder.layers[1:]:
            layer.mlp.router.expert_bias.zero_()
        plain = model(ids, position, None)
    assert (biased - plain).abs().max() > 1e-3
