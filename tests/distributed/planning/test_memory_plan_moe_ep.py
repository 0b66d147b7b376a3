"""The memory plan's expert-parallel fields against a built model: the MoE quickstart's actor
(tiny Qwen3-MoE at EP 2 on 2 ranks) generating and trained one step; the bytes of every tensor
it holds, by the plan's items (`rl3d.planning.held` counts storages), equal the plan's within 1%.

At EP 2 a rank holds 4 of each layer's 8 experts, in megatron's expert-parallel buffer that is
data-parallel over d / ep ranks (its distributed optimizer shards master and Adam states over
those, not over d); a plan that counted every expert on every rank is off by about half the
experts' bytes, far outside the tolerance."""

import pytest

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RECIPE = "recipes/quickstart_cpu_moe_grpo.yaml"
STATIC = ("params", "grads", "master", "optimizer")
TOLERANCE = 0.01


def held_worker(rank, world, overrides):
    import torch

    from rl3d.config import load_config
    from rl3d.config.pools import role_pools
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.planning import plan_memory
    from rl3d.planning.held import engine_held_bytes, role_held_bytes
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(RECIPE, overrides).config
    layout = role_pools(cfg)[0].layout
    groups = init_megatron(layout, seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    gen = torch.Generator().manual_seed(5)
    share = cfg.data.prompts_per_step // (actor.rollout.gen.d_g * layout.d)
    ids = [
        torch.randint(3, spec.vocab_size, (cfg.data.max_prompt_length,), generator=gen).tolist()
        for _ in range(share)
    ]
    actor.reshard()
    batch = actor.generate_sequences(DataBatch(meta={"prompt_ids": ids, "uid": list(range(share))}), step=0)
    engine = engine_held_bytes(actor)
    actor.release_generation()
    mask = batch["response_mask"]
    batch = batch.set("advantages", torch.ones_like(mask, dtype=torch.float32) * mask)
    actor.update_actor(batch)  # Adam's states exist after a step
    held = role_held_bytes(actor.role)
    local_experts = len(actor.role.unwrapped().decoder.layers[0].mlp.experts.local_experts)
    destroy_megatron()
    plan = plan_memory(cfg).ranks[rank]
    return (
        held,
        engine,
        plan.phases["train"]["actor"].items(),
        plan.phases["generate"]["engine"].items(),
        (local_experts),
    )


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_plan_equals_held_bytes_at_ep2(distributed_optimizer):
    overrides = [
        f"actor.optim.distributed_optimizer={str(distributed_optimizer).lower()}",
        "algorithm.kl.coef=0.0",
    ]
    for rank, (held, engine, planned, planned_engine, local_experts) in enumerate(
        run_distributed(held_worker, 2, overrides, timeout_s=300)
    ):
        assert local_experts == 4, rank
        for item in STATIC:
            want, got = planned[item], held[item]
            assert abs(got - want) <= TOLERANCE * max(want, 1), (rank, item, got, want)
        assert held["optimizer"] > 0
        # the other rank's experts, gathered for generation: the plan's resharded bytes
        want, got = planned_engine["resharded"], engine["resharded"]
        assert got > 0 and abs(got - want) <= TOLERANCE * want, (rank, got, want)
