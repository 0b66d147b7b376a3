"""The parameter inventory (`rl3d.models.params`) against the model megatron-core really builds."""

import pytest

from rl3d.models.builder import build_gpt
from rl3d.models.params import (
    LAYER_PARAMS,
    OUTPUT_LAYER,
    TE_NAMES,
    megatron_params,
    model_params,
    stage_param_names,
    stages_of,
)
from rl3d.models.spec import get_model_spec
from rl3d.parallel.sharding import ShardKind


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-odd-vocab"])
def test_inventory_is_the_built_model(groups_1x1, name, role):
    """Names, order and shapes of the built model at t=1 are the inventory's."""
    spec = get_model_spec(name)
    model = build_gpt(spec, groups_1x1, role=role)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert real == [(p.name, p.shape) for p in megatron_params(spec, role=role)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "llama3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("train_tp", [1, 2, 8])
def test_planner_inventory_is_the_same_parameters(name, train_tp):
    """`model_params` (forward order) holds `megatron_params` plus, when tied, the output copy."""
    spec = get_model_spec(name)
    planned = model_params(spec, train_tp=train_tp)
    built = megatron_params(spec, padded_vocab=planned[0].shape[0])
    assert {p.name: p for p in planned if not p.tied_copy} == {p.name: p for p in built}
    tied = [p for p in planned if p.tied_copy]
    assert [p.name for p in tied] == ([OUTPUT_LAYER] if spec.tied_embeddings else [])
    heads = (spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    qkv = [p for p in planned if p.kind is ShardKind.QKV]
    assert qkv and all(p.heads == heads for p in qkv)
    assert all(p.heads is None for p in planned if p.kind is not ShardKind.QKV)


def test_stages_cover_every_parameter_once():
    spec = get_model_spec("tiny-qwen2")
    params = megatron_params(spec)
    owned = [n for r in range(2) for n in stage_param_names(spec, 2, r)]
    assert sorted(owned) == sorted(p.name for p in params)
    tied = [p for p in model_params(spec, train_tp=1) if p.tied_copy]
    assert [list(stages_of(p, spec.num_layers, pp)) for p in tied for pp in (1, 2)] == [[], [1]]


def test_te_names_alias_layer_norms():
    suffixes = {p.suffix for p in LAYER_PARAMS}
    assert set(TE_NAMES) <= suffixes
    assert all(p.kind is ShardKind.REPLICATED for p in LAYER_PARAMS if p.suffix in TE_NAMES)
