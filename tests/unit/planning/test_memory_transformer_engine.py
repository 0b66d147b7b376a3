"""The memory plan counts the attention the builder will build, by the builder's own decision
(`use_transformer_engine`): a CUDA run without Transformer Engine refuses packing as the role
build does, rather than planning fused attention the run would not have. Preflight on a CUDA
host takes that host's TE (the GPU and the import are stood in for: CI has neither)."""

import sys
import types

import pytest

import rl3d.utils.device as device
from rl3d.config import load_config
from rl3d.launch.preflight_memory import MemoryPlanError, check_memory
from rl3d.models.builder import NeedsTransformerEngine
from rl3d.planning.memory import plan_memory

RECIPE = "recipes/gpu_llama2_7b_grpo.yaml"  # packing: fits 80 GiB by fused attention
GIB = 1 << 30


def test_a_plan_without_te_refuses_packing_like_the_build():
    cfg = load_config(RECIPE).config
    assert cfg.actor.packing and plan_memory(cfg, 80 * GIB, transformer_engine=True).fits
    with pytest.raises(NeedsTransformerEngine, match=r"^actor\.packing: true on a CUDA device"):
        plan_memory(cfg, 80 * GIB, transformer_engine=False)
    padded = load_config(RECIPE, ["actor.packing=false"]).config  # the local spec either way
    with_te, without = (plan_memory(padded, 80 * GIB, transformer_engine=te) for te in (True, False))
    assert with_te.ranks[0].peaks == without.ranks[0].peaks


def test_preflight_on_a_cuda_host_without_te_refuses_what_it_said_fits(monkeypatch):
    loaded = load_config(RECIPE)
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    monkeypatch.setattr(device, "device_total_bytes", lambda: 80 * GIB)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    check_memory(loaded)  # with TE: fits
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed
    with pytest.raises(MemoryPlanError, match="needs Transformer Engine") as refused:
        check_memory(loaded)
    assert refused.value.key == "actor.packing" and "set actor.packing: false" in str(refused.value)
