"""The role table: built-in roles by what the recipe enables, a recipe's own roles, and pools."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.pools import role_pools
from rl3d.config.roles import role_table

ROOT = Path(__file__).resolve().parents[3]
GRPO, PPO = ROOT / "recipes/quickstart_cpu_grpo.yaml", ROOT / "recipes/quickstart_cpu_ppo.yaml"
TOY = ["roles.toy.worker=toy_role:ResponseLengthWorker", "roles.toy.compute=compute_length"]


def names(cfg):
    return [r.name for r in role_table(cfg)]


def test_built_in_roles_follow_the_algorithm():
    assert names(load_config(GRPO).config) == ["actor", "reference"]
    assert names(load_config(PPO).config) == ["actor", "critic", "reference"]
    safe = load_config(ROOT / "recipes/quickstart_cpu_safe_rlhf.yaml").config
    assert names(safe) == ["actor", "critic", "cost_critic", "reference"]
    assert [p.roles for p in role_pools(safe)] == [("actor", "critic", "reference", "cost_critic")]


def test_a_recipe_role_is_one_table_entry_colocated_or_in_its_own_pool():
    cfg = load_config(GRPO, TOY).config
    toy = role_table(cfg)[-1]
    assert (toy.name, toy.compute, toy.compute_stage, toy.update) == ("toy", "compute_length", "toy", None)
    assert role_pools(cfg)[0].roles == ("actor", "reference", "toy")
    own = [*TOY, "roles.toy.colocate=false", "roles.toy.parallel.dp=2", "launch.nproc_per_node=4"]
    pools = role_pools(load_config(GRPO, own).config)
    assert [(p.name, list(p.ranks), p.roles) for p in pools][1] == ("toy", [2, 3], ("toy",))


def test_bad_recipe_roles_name_their_key():
    with pytest.raises(ConfigError, match=r"roles\.critic: 'critic' is a built-in role"):
        load_config(GRPO, ["roles.critic.worker=x:Y"])
    with pytest.raises(ConfigError, match=r"roles\.toy\.worker: 'toy_role' is not an import path"):
        load_config(GRPO, ["roles.toy.worker=toy_role"])
    bad_tp = [*TOY, "roles.toy.colocate=false", "roles.toy.parallel.tp=3", "launch.nproc_per_node=5"]
    with pytest.raises(ConfigError, match=r"roles\.toy\.parallel\.tp: tp=3 must divide"):
        load_config(GRPO, bad_tp)
