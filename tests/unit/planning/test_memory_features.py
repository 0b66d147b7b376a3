"""The memory plan and the engine agree on a role's techniques: the plan builds each role's
features from what the role's worker gives `MegatronEngine.from_config`, and counts what each
feature's footprint hook says (on, off, and on with the hook undone: off again)."""

from types import SimpleNamespace

import pytest

from rl3d.config import load_config
from rl3d.config.pools import role_pools
from rl3d.config.roles import role_table
from rl3d.controller.rank import build_worker
from rl3d.engine import Feature, FeatureSource
from rl3d.engine.techniques import Lora, Offload, Packing, Recompute, SequenceParallel, features_from
from rl3d.models.spec import spec_of
from rl3d.planning import plan_memory
from rl3d.planning.memory_roles import role_model
from rl3d.workers.context import RoleContext

PPO_RM = "recipes/quickstart_cpu_ppo_rm.yaml"  # actor, critic, reference, reward model at tp 2
LORA = "recipes/quickstart_cpu_lora_grpo.yaml"
SAFE_CM = "recipes/quickstart_cpu_safe_rlhf_cm.yaml"  # critic and cost critic, cost model
MOE = "recipes/quickstart_cpu_moe_grpo.yaml"
SPLIT = "parallel.sequence_parallel=true"
TRAINED = ["packing=true", "recompute=full", "offload=[grads,optimizer]"]
EVERY_TECHNIQUE = [
    *[f"actor.{k}" for k in TRAINED],
    "actor.max_tokens_per_micro_batch=100",
    *[f"critic.{k}" for k in TRAINED],
    *[f"{role}.{SPLIT}" for role in ("actor", "critic", "reference")],
    "reference.offload=[params]",
    "reward.model.packing=true",
]
CASES = {
    "ppo_rm": (
        PPO_RM,
        EVERY_TECHNIQUE,
        {
            "actor": ["sequence_parallel", "packing", "recompute", "offload", "fusions"],
            "critic": ["sequence_parallel", "packing", "recompute", "offload", "fusions"],
            "reference": ["sequence_parallel", "packing", "offload", "fusions"],
            "reward_model": ["packing", "fusions"],
        },
    ),
    "lora": (
        LORA,
        [f"actor.{k}" for k in TRAINED],
        {
            "actor": ["packing", "recompute", "lora", "offload", "fusions"]
        },  # the reference is the actor's base
    ),
    "safe_rlhf_cm": (
        SAFE_CM,
        ["critic.packing=true", "critic.recompute=full", "reward.cost_model.packing=true"],
        {
            "actor": ["fusions"],
            "critic": ["packing", "recompute", "fusions"],
            "cost_critic": ["packing", "recompute", "fusions"],
            "reference": ["fusions"],
            "cost_model": ["packing", "fusions"],
        },
    ),
    "moe": (
        MOE,
        ["algorithm.routing_replay=old"],
        {"actor": ["routing_replay", "moe", "fusions"], "reference": ["moe", "fusions"]},  # tp 1: no split
    ),
}


class _Built(Exception):
    """Raised where a worker's engine would build its features: carries their source."""


def engine_sources(cfg, monkeypatch) -> dict[str, FeatureSource]:
    """What each role's worker, built as a rank builds it (`build_worker` from the role table),
    gives its engine's `features_from`: its constructor is stopped there, before any model."""
    import rl3d.engine.megatron as megatron

    def stop(source):
        raise _Built(source)

    spec = spec_of(cfg.model)
    monkeypatch.setattr(megatron, "features_from", stop)
    # a learned model's weights are not read: its run's shape is the plan's (the recipe's model)
    monkeypatch.setattr("rl3d.config.reward_model.resolve_weights_dir", lambda path: path)
    monkeypatch.setattr("rl3d.workers.reward_model.reward_model_spec", lambda weights: spec)
    pools = {name: pool for pool in role_pools(cfg) for name in pool.roles}
    sources = {}
    for role in role_table(cfg):
        groups = SimpleNamespace(layout=pools[role.name].layout)  # what from_config reads of them
        ctx = RoleContext(cfg, spec, groups, tokenizer=None, init_from=object())
        try:
            build_worker(role, ctx)
        except _Built as built:
            sources[role.name] = built.args[0]
    return sources


def names(features) -> list[str]:
    return [f.name for f in features.items]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_builds_the_features_each_role_s_engine_builds(case, monkeypatch):
    recipe, overrides, want = CASES[case]
    cfg = load_config(recipe, overrides).config
    spec = spec_of(cfg.model)
    sources = engine_sources(cfg, monkeypatch)
    # the plan counts exactly the roles that build an engine (a LoRA actor's reference builds none)
    planned = {name for rank in plan_memory(cfg).ranks for name in rank.phases["train"]} - {"engine"}
    assert planned == set(sources) == set(want)
    pools = {name: pool for pool in role_pools(cfg) for name in pool.roles}
    for name, source in sources.items():
        role = role_model(cfg, name)
        assert role.source(spec, pools[name].layout.t) == source, name
        assert names(role.features(spec, pools[name].layout.t)) == names(features_from(source)) == want[name]


def _no_footprint(monkeypatch, technique: type[Feature]) -> None:
    monkeypatch.setattr(technique, "footprint", Feature.footprint)


def _train(cfg, role: str):
    return plan_memory(cfg).ranks[0].phases["train"][role]


# technique, recipe, the key that turns it on, the plan's part it changes
HOOKS = {
    "packing": (Packing, PPO_RM, ["critic.packing=true"], "critic", "train"),
    "sequence_parallel": (SequenceParallel, PPO_RM, [f"critic.{SPLIT}"], "critic", "train"),
    "recompute": (Recompute, PPO_RM, ["critic.recompute=full"], "critic", "train"),
    "offload": (Offload, PPO_RM, ["critic.offload=[params,grads,optimizer]"], "critic", "generate"),
    "lora": (Lora, LORA, [], "actor", "train"),
}


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_a_feature_s_footprint_hook_is_what_the_plan_counts(name, monkeypatch):
    technique, recipe, on, role, phase = HOOKS[name]
    off_keys = ["actor.lora=null"] if technique is Lora else []
    off = plan_memory(load_config(recipe, off_keys).config).ranks[0].phases[phase][role]
    cfg = load_config(recipe, on).config
    with_it = plan_memory(cfg).ranks[0].phases[phase][role]
    assert with_it != off  # the technique changes the role's bytes
    _no_footprint(monkeypatch, technique)
    undone = plan_memory(cfg).ranks[0].phases[phase][role]
    assert undone == off  # ...only through its footprint: without the hook, the plan is off's
    if technique in (Packing, SequenceParallel, Recompute):  # the micro-batch's shape only
        assert with_it.static == off.static and with_it.activations != off.activations
    if technique is Offload:  # nothing of the critic's left on the device while generating
        assert with_it.total == 0 < off.total


def test_the_reference_follows_the_actor_s_packing_through_its_features():
    """`cfg.reference.batching_of(cfg.actor)`: the reference packs as the actor does unless it
    says otherwise, in the plan as in its engine."""
    cfg = load_config(PPO_RM, ["actor.packing=true", "actor.max_tokens_per_micro_batch=64"]).config
    packing = role_model(cfg, "reference").features(spec_of(cfg.model), 2).get(Packing)
    assert packing is not None and packing.max_tokens == 64
    unpacked = load_config(PPO_RM, ["actor.packing=true", "reference.packing=false"]).config
    assert role_model(unpacked, "reference").features(spec_of(cfg.model), 2).get(Packing) is None
    assert _train(cfg, "reference").activations < _train(unpacked, "reference").activations
