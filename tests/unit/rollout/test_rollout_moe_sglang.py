"""The SGLang adapter's tensors for Qwen3-MoE, Qwen2-MoE and GLM-4.5: the HF checkpoint's names
and values, and every name one that the pinned wheel's loader (qwen3_moe.py / qwen2_moe.py /
glm4_moe.py `load_weights`, read with `ast`, never imported) routes to a parameter of its model."""

import ast

import pytest
import torch
from hf_to_engine import shard_kind, tiny_hf_model
from sglang_wheel import wheel_or_skip

from rl3d.models.params import (
    EXPERT_BIAS,
    K_NORM,
    Q_NORM,
    ROUTER,
    SHARED_FC1,
    SHARED_FC2,
    SHARED_GATE,
    megatron_params,
)
from rl3d.ops.layouts import shard_for_tp
from rl3d.rollout.sglang_weights import megatron_to_hf

MODELS = {  # tiny model -> (SGLang model file, its MoE block, attention, shared-expert MLP classes)
    "tiny-qwen3-moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeAttention", "Qwen2MoeMLP"),
    "tiny-qwen2-moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeAttention", "Qwen2MoeMLP"),
    "tiny-glm4-moe": ("glm4_moe", "Glm4MoeSparseMoeBlock", "Glm4MoeAttention", "Glm4MoeMLP"),
}
SHARED_MLP_FILE = {"Qwen2MoeMLP": "qwen2_moe", "Glm4MoeMLP": "glm4_moe"}
FUSED_MOE = "sglang/srt/layers/moe/fused_moe_triton/layer.py"


MOE_AND_QK_NORM = (Q_NORM, K_NORM, ROUTER, EXPERT_BIAS, SHARED_FC1, SHARED_FC2, SHARED_GATE)


def adapter_state(name, tp=2):
    """The adapter's whole HF tensors, built from t=2 shards of every parameter."""
    spec, model, full = tiny_hf_model(name)
    state = {}
    for mname, t in full.items():
        shards = [shard_for_tp(t, shard_kind(spec, mname), tp, r) for r in range(tp)]
        for hf_name, hf_t in megatron_to_hf(spec, mname, shards):
            assert hf_name not in state
            state[hf_name] = hf_t
    return spec, model, state


@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_gives_the_hf_checkpoint_tensors(name):
    """Per-expert names (as a checkpoint stores them) holding the HF model's fused experts'
    slices; every other tensor under the model's own name, bit for bit."""
    spec, model, state = adapter_state(name)
    hf = model.state_dict()
    fe = spec.moe_ffn_hidden_size
    for i in range(spec.moe_first_dense_layers, spec.num_layers):
        p = f"model.layers.{i}.mlp."
        gate_up, down = hf.pop(p + "experts.gate_up_proj"), hf.pop(p + "experts.down_proj")
        for e in range(spec.num_experts):
            ex = f"{p}experts.{e}."
            assert torch.equal(state.pop(ex + "gate_proj.weight"), gate_up[e, :fe])
            assert torch.equal(state.pop(ex + "up_proj.weight"), gate_up[e, fe:])
            assert torch.equal(state.pop(ex + "down_proj.weight"), down[e])
    assert state.keys() == hf.keys()
    assert all(torch.equal(state[k], hf[k]) for k in hf)


@pytest.fixture(scope="module")
def wheel():
    return wheel_or_skip()


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    """The `self.X = ...` attributes a class assigns anywhere in its body."""
    return {
        t.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }


def _load_weights(wheel, path: str) -> tuple[list, dict[str, str]]:
    """`load_weights`' stacked_params_mapping and the checkpoint names it passes to
    `FusedMoE.make_expert_params_mapping`."""
    fn = next(
        n for n in ast.walk(wheel.tree(path)) if isinstance(n, ast.FunctionDef) and n.name == "load_weights"
    )
    stacked = next(
        ast.literal_eval(n.value)
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "stacked_params_mapping"
    )
    call = next(
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "FusedMoE.make_expert_params_mapping"
    )
    return stacked, {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg.startswith("ckpt_")}


@pytest.mark.parametrize("name", list(MODELS))
def test_wheel_loader_routes_every_moe_name(wheel, name):
    module, block, attention, shared_cls = MODELS[name]
    path = f"sglang/srt/models/{module}.py"
    stacked, ckpt = _load_weights(wheel, path)
    # the loader's expert names: f"experts.{expert_id}.{weight_name}." for the three ckpt names,
    # with the global expert id (the weight loader maps it to the EP rank's slot)
    fused = wheel.tree(FUSED_MOE)
    template = next(
        ast.unparse(n)
        for n in ast.walk(
            next(x for x in ast.walk(fused) if getattr(x, "name", "") == "make_expert_params_mapping")
        )
        if isinstance(n, ast.JoinedStr)
    )
    assert template == "f'experts.{expert_id}.{weight_name}.'"
    assert set(ckpt.values()) == {"gate_proj", "up_proj", "down_proj"}
    text = wheel.text(path)
    assert f"self.mlp = {block}(" in text and f"self.self_attn = {attention}(" in text  # the decoder layer
    assert 'if "mlp.experts" in name:' in text  # experts skip the stacked (dense) path
    # contiguous blocks of experts per expert-parallel rank
    assert "start_idx = self._expert_storage_rank * self._num_local_routed" in wheel.text(FUSED_MOE)

    spec = tiny_hf_model(name)[0]
    mlp_attrs = _self_attrs(wheel.class_node(path, block))
    attn_attrs = _self_attrs(wheel.class_node(path, attention))
    shared_mlp = _self_attrs(
        wheel.class_node(f"sglang/srt/models/{SHARED_MLP_FILE[shared_cls]}.py", shared_cls)
    )
    stacked_from = {weight: param for param, weight, _ in stacked}
    routed = []
    extra = [p for p in megatron_params(spec) if p.name.endswith(MOE_AND_QK_NORM) or p.expert is not None]
    for param in extra:
        for hf_name in param.hf:
            parts = hf_name.split(".")  # model.layers.{i}.<module>.<...>.weight
            where = parts[3:-1]
            if where[:2] == ["mlp", "experts"]:
                assert f"experts.{where[2]}.{where[3]}." in hf_name and where[3] in ckpt.values()
            elif where[0] == "self_attn":
                assert where[1] in attn_attrs, hf_name
            elif where[:2] in (["mlp", "shared_expert"], ["mlp", "shared_experts"]):
                assert where[1] in mlp_attrs and stacked_from.get(where[2], where[2]) in shared_mlp
            elif hf_name.endswith("mlp.gate.e_score_correction_bias"):  # GLM's router bias
                assert "gate" in mlp_attrs
                assert "e_score_correction_bias" in _self_attrs(wheel.class_node(path, "Glm4MoeGate"))
            else:
                assert where[0] == "mlp" and where[1] in mlp_attrs, hf_name  # the router: mlp.gate
            routed.append(hf_name)
    assert len(routed) == sum(len(p.hf) for p in extra) > 0
