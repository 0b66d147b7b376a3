"""The transition from an expert-parallel training layout on real megatron MoE models: the actor
worker's `reshard` (the path a GRPO step takes) gives every generation rank every expert of its
stage, and each generation weight equals the slice of the original HF checkpoint bit for bit.

A rank trains only its EP rank's experts (megatron-core builds the EP groups; rl3d's layout is
checked against them at bootstrap), so if the planner took an expert from a rank that does not
hold it, the gather would miss the tensor or deliver another expert's values. The bytes each rank
counts equal the plan's. With `hybrid_engine.verify` the executor also checks each shard against
the full model gathered by another path (every expert from the data-parallel rank training it).
GLM-4.5 (a dense first layer, the router's expert bias: a megatron buffer the inventory lists)
moves the same way: every bias arrives bit for bit, counted = planned.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RECIPE = "recipes/quickstart_cpu_grpo.yaml"


def worker(rank, world, hf_dir, p, t, d, ep, t_g, etp=None):
    from safetensors.torch import load_file

    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.hf_mapping import tensor_maps
    from rl3d.models.spec import spec_of
    from rl3d.ops.layouts import shard_for_tp
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(
        RECIPE,
        [
            "model.name=null",
            f"model.hf_path={hf_dir}",
            "model.dtype=float32",
            f"actor.parallel={{pp: {p}, tp: {t}, dp: {d}, ep: {ep}, etp: {'null' if etp is None else etp}}}",
            f"launch.nproc_per_node={world}",
            f"rollout.t_g={t_g}",
            "hybrid_engine.verify=true",  # and the executor's own check against the gathered model
        ],
    ).config
    layout = ParallelLayout(p, t, d, ep=ep, etp=etp)
    groups = init_megatron(layout, seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    held = {n for n in actor.role.global_shards() if ".local_experts." in n}
    metrics = actor.reshard()
    weights = actor.rollout.weights  # the generation weights the engine was loaded with
    original = load_file(f"{hf_dir}/model.safetensors")
    padded = actor.rollout.resharder.by_name["embedding.word_embeddings.weight"].shape[0]
    tp_g = actor.rollout.gen.coords(rank).tp_g
    mismatched, checked, biases = [], 0, 0
    for m in tensor_maps(spec, padded):
        if m.mcore not in weights.names():
            continue
        full = m.to_mcore([original[h] for h in m.hf])
        expected = shard_for_tp(full, m.kind, t_g, tp_g)
        checked += 1
        biases += m.mcore.endswith("expert_bias")
        if not torch.equal(weights.reference_materialize(m.mcore), expected):
            mismatched.append(m.mcore)
    stats = actor.rollout.resharder.last_stats
    planned = actor.rollout.resharder.plan.ranks[rank]
    experts = {n.split(".local_experts.")[1].split(".")[0] for n in weights.names() if ".local_experts." in n}
    destroy_megatron()
    return {
        "held_experts": len(held),
        "gen_experts": len(experts),
        "checked": checked,
        "biases": biases,
        "mismatched": mismatched,
        "recv": stats.recv_bytes,
        "planned_recv": planned.recv_bytes,
        "send": stats.send_bytes,
        "planned_send": planned.send_bytes,
        "metric_bytes": metrics["reshard/bytes"],
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    out = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", out, seed=7)
    return out


@pytest.mark.parametrize(
    ("p", "t", "d", "ep", "t_g"),
    [
        (1, 1, 2, 2, 1),  # dense weights in place, experts across the EP group
        (1, 2, 2, 2, 1),  # TP folds into micro-DP: experts over 4 ranks
        (1, 2, 2, 2, 2),  # generation TP 2: each rank the TP half of every expert
        (2, 1, 2, 2, 1),  # PP folds into micro-DP: norms and experts of both stages
    ],
)
def test_expert_parallel_weights_reshard_bit_for_bit(hf_dir, p, t, d, ep, t_g):
    world = p * t * d
    results = run_distributed(worker, world, str(hf_dir), p, t, d, ep, t_g, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert r["checked"] > 0
        # a rank trains the experts of its EP rank and its stage; generates with all 8 of its stage
        assert r["held_experts"] == 2 * 8 // ep * (2 // p), rank
        assert r["gen_experts"] == 8, rank
        assert r["recv"] == r["planned_recv"] == r["metric_bytes"] > 0, rank
        assert r["send"] == r["planned_send"], rank


@pytest.mark.parametrize(
    ("p", "t", "d", "ep", "etp", "t_g"),
    [
        (1, 2, 2, 2, 1, 1),  # expert TP 1 at TP 2: a TP group is an EP group, experts whole
        (1, 2, 2, 4, 1, 1),  # one EP group of all 4 ranks
        (2, 2, 1, 2, 1, 1),  # PP folds into micro-DP: norms and experts of both stages
        (1, 2, 2, 2, 1, 2),  # generation TP 2: each rank a half of every expert, point to point
        (2, 2, 1, 2, 1, 2),  # ... with the experts of the other stage's ranks untouched
    ],
)
def test_expert_tensor_parallel_weights_reshard_bit_for_bit(hf_dir, p, t, d, ep, etp, t_g):
    """Experts trained whole (etp 1) on the ranks megatron's expert grid gives them, dense
    weights TP-split: each generation rank gets its t_g shard of every expert of its stage from
    its holders, equal to the HF checkpoint bit for bit, counted = planned."""
    world = p * t * d
    results = run_distributed(worker, world, str(hf_dir), p, t, d, ep, t_g, etp, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert r["checked"] > 0
        assert r["held_experts"] == 2 * 8 // ep * (2 // p), rank
        assert r["gen_experts"] == 8, rank
        assert r["recv"] == r["planned_recv"] == r["metric_bytes"] > 0, rank
        assert r["send"] == r["planned_send"], rank


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    out = tmp_path_factory.mktemp("hf") / "tiny-glm4-moe"
    save_tiny_hf_model("tiny-glm4-moe", out, seed=7)
    return out


@pytest.mark.parametrize(
    ("p", "t", "d", "ep", "t_g"),
    [
        (2, 1, 2, 2, 1),  # stage 0: the dense layer and 1 MoE layer; stage 1: 2 MoE layers
        (1, 2, 2, 2, 2),  # generation TP 2: each rank the TP half of every expert, whole biases
    ],
)
def test_glm_weights_and_router_biases_reshard_bit_for_bit(glm_dir, p, t, d, ep, t_g):
    world = p * t * d
    results = run_distributed(worker, world, str(glm_dir), p, t, d, ep, t_g, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert r["biases"] == 3, rank  # the 3 MoE layers' expert biases (t_g 1 or 2: whole each)
        assert r["gen_experts"] == 8, rank
        assert r["recv"] == r["planned_recv"] == r["metric_bytes"] > 0, rank
        assert r["send"] == r["planned_send"], rank


@pytest.mark.parametrize(("p", "t", "d", "ep", "t_g"), [(2, 1, 2, 2, 1), (1, 2, 2, 2, 1)])
def test_deepseek_mla_and_router_biases_reshard_bit_for_bit(tmp_path, p, t, d, ep, t_g):
    """DeepSeek-V3 (tiny: MLA's low-rank projections and norms, 16 experts in 4 groups, the
    routers' biases) into the torch engine at t_g 1: every weight bit for bit, counted = planned."""
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    save_tiny_hf_model("tiny-deepseek-v3", tmp_path / "hf", seed=7)
    results = run_distributed(worker, p * t * d, str(tmp_path / "hf"), p, t, d, ep, t_g, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert r["biases"] == 3 and r["gen_experts"] == 16, rank
        assert r["recv"] == r["planned_recv"] == r["metric_bytes"] > 0, rank
        assert r["send"] == r["planned_send"], rank
