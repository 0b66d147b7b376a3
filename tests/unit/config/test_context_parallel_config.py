"""`<role>.parallel.cp`: default 1 (a run as before), a CP layout loads and counts its ranks,
and what context parallelism does not run with is refused with the key that must change."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.pools import layout_of, role_pools

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
PPO = ROOT / "recipes/quickstart_cpu_ppo.yaml"
CP2 = ["actor.parallel={tp: 1, pp: 1, dp: 1, cp: 2}", "rollout.t_g=1"]


def test_default_is_1_and_a_cp_layout_counts_its_ranks():
    assert load_config(GRPO).config.actor.parallel.cp == 1
    cfg = load_config(GRPO, ["actor.parallel={tp: 2, pp: 1, dp: 1, cp: 2}", "launch.nproc_per_node=4"]).config
    layout = layout_of(cfg.actor.parallel)
    assert (layout.t, layout.cp, layout.d, layout.world_size) == (2, 2, 1, 4)
    assert role_pools(cfg)[0].size == 4
    # a critic in its own pool at its own cp, after the actor's 2 ranks
    own = ["critic.colocate=false", "critic.parallel={tp: 1, pp: 1, dp: 1, cp: 2}", "launch.nproc_per_node=4"]
    cfg = load_config(PPO, [*CP2, *own]).config
    assert [(p.name, p.offset, p.size, p.layout.cp) for p in role_pools(cfg)] == [
        ("actor", 0, 2, 2),
        ("critic", 2, 2, 2),
    ]


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        (GRPO, ["actor.parallel.cp=0"], r"actor\.parallel\.cp: must be > 0, got 0"),
        (
            GRPO,
            ["actor.parallel={tp: 2, pp: 1, dp: 1, cp: 2}"],
            r"launch\.nproc_per_node: world size .* = 2 does not match actor p\*t\*cp\*d = 1\*2\*2\*1 = 4",
        ),
        (
            GRPO,
            [*CP2, "model.name=tiny-qwen3-moe", "actor.parallel.ep=2", "actor.parallel.dp=2"],
            r"actor\.parallel\.cp: cp=2 with experts split \(ep=2",
        ),
        (GRPO, [*CP2, "model.name=tiny-qwen3-moe"], r"actor\.parallel\.cp: cp=2: a mixture of experts"),
        (GRPO, [*CP2, "actor.packing=true"], r"actor\.packing: true: actor's layout has cp=2"),
        (
            GRPO,
            [*CP2, "algorithm.kl.coef=0.1", "reference.packing=true"],
            r"reference\.packing: true: reference's layout has cp=2",
        ),
        (
            PPO,
            [*CP2, "critic.parallel={tp: 1, pp: 1, dp: 1, cp: 1}"],
            r"critic\.parallel: a colocated critic uses the actor's layout tp=1 pp=1 dp=1 cp=2",
        ),
    ],
)
def test_refusals_name_the_key(recipe, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(recipe, overrides)
