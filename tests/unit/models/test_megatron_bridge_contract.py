"""rl3d's HF <-> megatron-core parameter names against NVIDIA's Megatron-Bridge, read from the
pinned wheel's source (never installed or imported: it requires transformer-engine[core_cu13],
mamba-ssm and causal-conv1d, CUDA builds, and transformers<5 where rl3d pins 5.x; its
`param_mapping` module imports transformer_engine at the top).

For every family both have, each of rl3d's `tensor_maps` (layer and expert numbers written `*`,
as the bridge writes them) must be one of the bridge's mappings for that architecture: the same
megatron-core name made of the same HF tensors in the same order (Q, K, V; gate, up). The bridge
also lists Transformer Engine's fused names; rl3d builds the local spec, whose names match their
Transformer Engine form where a bridge lists only that (`TE_NAMES`: a layer norm fused into the
next linear layer, a SequentialMLP expert as TEGroupedMLP's `experts.linear_fc1.weight*`)."""

from __future__ import annotations

import ast
import re
import zipfile

import pytest

from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.spec import MODEL_SPECS, hf_model_type
from rl3d.testing.wheels import pinned_wheel

BRIDGE_VERSION = "0.3.1"
# the keywords of each mapping class that name HF tensors, in the order they make the megatron one
HF_KEYWORDS = {
    "AutoMapping": ("hf_param",),
    "DirectMapping": ("hf_param",),
    "ColumnParallelMapping": ("hf_param",),
    "RowParallelMapping": ("hf_param",),
    "ReplicatedMapping": ("hf_param",),
    "QKVMapping": ("q", "k", "v"),
    "GatedMLPMapping": ("gate", "up"),
}


@pytest.fixture(scope="module")
def bridge() -> zipfile.ZipFile:
    found = pinned_wheel("megatron-bridge", BRIDGE_VERSION)
    if isinstance(found, str):
        pytest.skip(found)
    return zipfile.ZipFile(found)


def _registered_source(node: ast.ClassDef) -> str | None:
    """The HF class a bridge class is registered for (`@...register_bridge(source=X, ...)`)."""
    for deco in node.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("register_bridge"):
            for kw in deco.keywords:
                if kw.arg == "source":
                    value = kw.value
                    return value.value if isinstance(value, ast.Constant) else ast.unparse(value)
    return None


def _mappings(tree: ast.AST) -> set[tuple[str, tuple[str, ...]]]:
    """(megatron name, HF names) of every literal mapping in `tree`: the name -> name dicts the
    bridges turn into AutoMappings, and every mapping class called with literal names."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Dict)
            and node.keys
            and all(
                isinstance(x, ast.Constant) and isinstance(x.value, str) for x in [*node.keys, *node.values]
            )
        ):
            out |= {(k.value, (v.value,)) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.Call) and ast.unparse(node.func) in HF_KEYWORDS:
            kw = {k.arg: k.value for k in node.keywords}
            names = [kw.get(key) for key in ("megatron_param", *HF_KEYWORDS[ast.unparse(node.func)])]
            if all(isinstance(n, ast.Constant) for n in names):
                out.add((names[0].value, tuple(n.value for n in names[1:])))
    return out


def bridge_mappings(wheel: zipfile.ZipFile) -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    """HF architecture class name -> the bridge's mappings for it (its module and the helper
    modules of its own package that it imports, e.g. deepseek/common.py)."""
    out: dict[str, set] = {}
    for name in wheel.namelist():
        if not (name.startswith("megatron/bridge/models/") and name.endswith("_bridge.py")):
            continue
        tree = ast.parse(wheel.read(name).decode())
        package = name.rsplit("/", 1)[0].replace("/", ".")
        helpers = [
            node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + ".")
        ]  # fmt: skip
        found = _mappings(tree)
        for module in helpers:
            path = module.replace(".", "/") + ".py"
            if path in wheel.namelist():
                found |= _mappings(ast.parse(wheel.read(path).decode()))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (source := _registered_source(node)):
                out.setdefault(source, set()).update(found)
    return out


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


# rl3d's local-spec names -> Transformer Engine's, for bridges that list only the latter: the
# layer norms fused into the next linear layer, the experts grouped into one module
TE_NAMES = [
    (r"\.input_layernorm\.weight$", ".self_attention.linear_qkv.layer_norm_weight"),
    (r"\.pre_mlp_layernorm\.weight$", ".mlp.linear_fc1.layer_norm_weight"),
    (r"experts\.local_experts\.\*\.(linear_fc\d)\.(weight|bias)$", r"experts.\1.\2*"),
]


def _te_forms(mcore: str) -> set[str]:
    return {re.sub(pattern, te, mcore) for pattern, te in TE_NAMES} - {mcore}


def _tiny_of_each_family() -> dict[str, str]:
    """HF model_type -> the smallest registered spec of that family."""
    out: dict[str, str] = {}
    for name, spec in sorted(MODEL_SPECS.items(), key=lambda kv: kv[1].hidden_size * kv[1].num_layers):
        try:
            out.setdefault(hf_model_type(spec), name)
        except (KeyError, ValueError):
            continue
    return out


FAMILIES = _tiny_of_each_family()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_rl3d_names_are_the_bridges(bridge, model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    known = bridge_mappings(bridge)
    if architecture not in known:
        pytest.skip(f"Megatron-Bridge {BRIDGE_VERSION} has no bridge for {architecture}")
    theirs = known[architecture]
    spec = MODEL_SPECS[FAMILIES[model_type]]
    ours = {(_pattern(m.mcore), tuple(_pattern(h) for h in m.hf)) for m in tensor_maps(spec, spec.vocab_size)}
    missing = sorted(
        (mcore, hf)
        for mcore, hf in ours
        if (mcore, hf) not in theirs and not any((te, hf) in theirs for te in _te_forms(mcore))
    )
    assert not missing, f"{FAMILIES[model_type]} ({architecture}): names the bridge maps otherwise: {missing}"
    assert len(ours) >= 8  # embedding, norms, attention, MLP: a whole decoder layer was compared


def test_every_family_of_rl3d_has_a_bridge_but_qwen2_moe(bridge):
    """Which of rl3d's families the bridge covers (so that a family added to rl3d is compared)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = bridge_mappings(bridge)
    uncovered = {t for t in FAMILIES if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] not in known}
    assert uncovered == {"qwen2_moe"}, uncovered
