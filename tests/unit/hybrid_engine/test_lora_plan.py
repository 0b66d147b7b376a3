"""The adapter-only transition: the adapters as planner parameters, their planned bytes against
a hand count, and `rl3d plan`'s LoRA section beside the full transition."""

import json
from pathlib import Path

import pytest

from rl3d.cli import main
from rl3d.hybrid_engine.lora_plan import lora_params, plan_lora_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.parallel.sharding import ShardKind

ROOT = Path(__file__).resolve().parents[3]
H, F, L = 4096, 11008, 32  # llama2-7b: hidden, ffn, layers (32 heads, 32 KV heads, head dim 128)


def test_adapters_as_planner_params():
    spec = get_model_spec("tiny-llama")
    params = {p.name: p for p in lora_params(spec, 4, ("q_proj", "down_proj"))}
    assert len(params) == 4 * spec.num_layers
    q_a = params["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    q_b = params["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    down_a = params["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"]
    down_b = params["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    # column-parallel q: B's rows split like the base's output rows; row-parallel down: A's columns
    assert (q_a.kind, q_b.kind, down_a.kind, down_b.kind) == (
        ShardKind.REPLICATED, ShardKind.COLUMN, ShardKind.ROW, ShardKind.REPLICATED,
    )  # fmt: skip
    assert q_a.shape == (4, spec.hidden_size) and down_a.shape == (4, spec.ffn_hidden_size)
    assert q_a.layer == 1 and down_b.shape == (spec.hidden_size, 4)
    with pytest.raises(ValueError, match="name one or more of q_proj"):
        lora_params(spec, 4, ("qkv",))


def test_7b_bytes_equal_hand_count():
    t = plan_lora_transition(get_model_spec("llama2-7b"), ParallelLayout(1, 4, 2), 2, rank=8)
    s = t.summary()
    per_layer = 8 * (4 * (H + H) + 3 * (H + F))  # r * (in + out) of q k v o and gate up down
    assert s["adapter_bytes"] == 4 * L * per_layer  # fp32 adapters
    # t=4 -> t_g=2: a rank receives the one other training shard of each split factor; the
    # whole factors (A of q/k/v/gate/up, B of o/down) every rank already holds
    split = 8 * (4 * H + 3 * F)
    assert s["lora_recv_max"] == s["lora_recv_mean"] == 4 * L * split // 4
    assert s["full_recv_max"] > 250 * s["lora_recv_max"]
    identity = plan_lora_transition(get_model_spec("llama2-7b"), ParallelLayout(1, 4, 2), 4, rank=8)
    assert identity.summary()["lora_recv_max"] == 0


@pytest.mark.parametrize("recipe", ["gpu_llama2_7b_grpo.yaml", "gpu_llama2_70b_grpo.yaml"])
def test_rl3d_plan_shows_lora_beside_full(recipe, capsys):
    path = str(ROOT / "recipes" / recipe)
    assert main(["plan", path, "--lora-rank", "8", "--strategy", "hybridflow"]) == 0
    text = capsys.readouterr().out
    assert "LoRA transition (rank 8" in text and "adapters" in text and "full model" in text
    assert main(["plan", path, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert lora["targets"] == ["q_proj", "v_proj"] and lora["rank"] == 16
    assert 0 < lora["lora_recv_max"] < lora["full_recv_max"] / 100
    assert main(["plan", path, "--json"]) == 0
    assert "lora" not in json.loads(capsys.readouterr().out)  # no LoRA asked, none planned
