"""The recipe loader: composition order, overrides, provenance and every error class."""

from pathlib import Path

import pytest

import yaml
from rl3d.config import ConfigError, load_config, parse_override, write_resolved_config

BASE_RECIPE = """
defaults:
  - models/m
  - algos/a
actor:
  parallel: {tp: 2, pp: 1, dp: 1}
  mini_batch_size: 8
  micro_batch_size: 4
rollout: {n: 2, t_g: 1}
data:
  synthetic: {task: copy_first}
  prompts_per_step: 4
launch: {nproc_per_node: 2}
"""


def write_tree(root: Path, recipe: str = BASE_RECIPE, blocks: dict[str, str] | None = None) -> Path:
    blocks = {
        "models/m.yaml": "model: {name: tiny-llama, dtype: float32}\n",
        "algos/a.yaml": "algorithm: {adv_estimator: grpo, clip_high: 0.28}\nrollout: {n: 8}\n",
        **(blocks or {}),
    }
    for name, text in blocks.items():
        path = root / "yaml" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    recipe_path = root / "recipes" / "r.yaml"
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(recipe)
    return recipe_path


def test_blocks_then_recipe_then_overrides(tmp_path):
    recipe = write_tree(tmp_path)
    loaded = load_config(recipe, ["algorithm.clip_low=0.1", "rollout.temperature=0.5"])
    cfg = loaded.config
    assert cfg.model.name == "tiny-llama"
    assert cfg.algorithm.clip_high == 0.28  # from the block
    assert cfg.rollout.n == 2  # the recipe beats the block
    assert cfg.algorithm.clip_low == 0.1  # the command line beats both
    assert cfg.rollout.temperature == 0.5
    assert [Path(f).name for f in loaded.files] == ["m.yaml", "a.yaml", "r.yaml"]
    assert loaded.source_of("algorithm.clip_high").endswith("a.yaml")
    assert loaded.source_of("rollout.n").endswith("r.yaml")
    assert loaded.source_of("algorithm.clip_low") == "command line"


def test_nested_defaults_apply_before_the_block(tmp_path):
    recipe = write_tree(
        tmp_path,
        blocks={
            "algos/a.yaml": "defaults: [algos/base]\nalgorithm: {clip_high: 0.3}\n",
            "algos/base.yaml": "algorithm: {adv_estimator: rloo, clip_high: 0.1, entropy_coef: 0.01}\n",
        },
    )
    cfg = load_config(recipe).config
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.algorithm.clip_high == 0.3
    assert cfg.algorithm.entropy_coef == 0.01


def test_unknown_key_has_did_you_mean_and_names_file(tmp_path):
    recipe = write_tree(tmp_path, BASE_RECIPE + "trainer: {totl_steps: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    msg = str(err.value)
    assert "r.yaml" in msg and "trainer.totl_steps" in msg and "did you mean 'trainer.total_steps'" in msg
    assert err.value.key == "trainer.totl_steps"


def test_unknown_top_level_key(tmp_path):
    recipe = write_tree(tmp_path, BASE_RECIPE + "rolout: {n: 3}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: rolout: unknown key \(did you mean 'rollout'\?\)"):
        load_config(recipe)


def test_wrong_type_names_block_file(tmp_path):
    recipe = write_tree(tmp_path, blocks={"algos/a.yaml": "algorithm: {gamma: fast}\n"})
    with pytest.raises(ConfigError, match=r"a\.yaml: algorithm\.gamma: expected a number, got 'fast'"):
        load_config(recipe)


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("trainer.total_steps=2.5", r"trainer\.total_steps: expected an integer"),
        ("logging.jsonl=maybe", r"logging\.jsonl: expected true or false"),
        ("rollout.engine=vllm", r"rollout\.engine: expected one of 'torch', 'sglang'"),
        ("rollout.stop_token_ids=[1,x]", r"rollout\.stop_token_ids\[1\]: expected an integer"),
        ("actor.parallel=3", r"actor\.parallel: expected a mapping"),
    ],
)
def test_wrong_types_from_command_line(tmp_path, override, pattern):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match="command line: " + pattern):
        load_config(recipe, [override])


def test_missing_required_key(tmp_path):
    recipe = write_tree(tmp_path, blocks={"models/m.yaml": "model: {dtype: float32}\n"})
    with pytest.raises(ConfigError, match=r"model\.name: missing required key"):
        load_config(recipe)


def test_missing_required_section(tmp_path):
    text = BASE_RECIPE.replace("data:\n  synthetic: {task: copy_first}\n  prompts_per_step: 4\n", "")
    recipe = write_tree(tmp_path, text)
    with pytest.raises(ConfigError, match=r"r\.yaml: data: missing required key"):
        load_config(recipe)


def test_cycle_in_defaults_is_reported_with_the_chain(tmp_path):
    recipe = write_tree(
        tmp_path,
        blocks={"algos/a.yaml": "defaults: [algos/b]\n", "algos/b.yaml": "defaults: [algos/a]\n"},
    )
    with pytest.raises(ConfigError, match=r"cycle in defaults: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(recipe)


def test_missing_block_file(tmp_path):
    recipe = write_tree(tmp_path, BASE_RECIPE.replace("algos/a", "algos/nope"))
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found \(listed in defaults of .*r\.yaml\)"):
        load_config(recipe)


def test_invalid_yaml_names_file_and_line(tmp_path):
    recipe = write_tree(tmp_path, blocks={"algos/a.yaml": "algorithm:\n  gamma: [1,\n"})
    with pytest.raises(ConfigError, match=r"a\.yaml: invalid YAML at line \d+"):
        load_config(recipe)


def test_t_g_must_divide_t(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"command line: rollout\.t_g: .*t_g=4 must divide training t=2"):
        load_config(recipe, ["rollout.t_g=4"])


def test_p_g_must_divide_p(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"rollout\.p_g: .*p_g=2 must divide training p=1"):
        load_config(recipe, ["rollout.p_g=2"])


def test_world_size_must_be_p_t_d(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(
        ConfigError, match=r"launch\.nproc_per_node: world size .* = 3 does not match actor p\*t\*d"
    ):
        load_config(recipe, ["launch.nproc_per_node=3"])


def test_tp_must_divide_kv_heads(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp: tp=8 must divide the model's 4 KV heads"):
        load_config(recipe, ["actor.parallel.tp=8", "launch.nproc_per_node=8"])


def test_mini_batch_must_divide_step_samples(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(
        ConfigError, match=r"r\.yaml: actor\.mini_batch_size: 8 must divide the step's samples.*= 6"
    ):
        load_config(recipe, ["data.prompts_per_step=3"])


def test_micro_batch_must_split_over_dp(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"command line: actor\.micro_batch_size: .*multiple of 6"):
        load_config(recipe, ["actor.micro_batch_size=3", "actor.parallel.dp=2", "launch.nproc_per_node=4"])


def test_component_field_check_names_key(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"command line: rollout\.top_p: must be in \(0, 1\]"):
        load_config(recipe, ["rollout.top_p=1.5"])


def test_grpo_needs_several_samples(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"rollout\.n: grpo compares samples of one prompt"):
        load_config(recipe, ["rollout.n=1"])


def test_gae_without_critic_is_rejected(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"critic\.enabled: advantage estimator 'gae' needs a critic"):
        load_config(recipe, ["algorithm.adv_estimator=gae", "critic.enabled=false"])


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="command line: override .* is not of the form key.sub=value"):
        parse_override(bad)


def test_override_values_are_yaml_typed():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("x.y=hello") == ("x.y", "hello")


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("-2.5E-4", -2.5e-4), ("+1e3", 1e3), (".5e1", 5.0)])
def test_exponent_floats_are_numbers(text, value):
    # YAML 1.1 needs a dot in the mantissa; recipes accept YAML 1.2 floats such as 1e-3.
    assert parse_override(f"actor.optim.lr={text}") == ("actor.optim.lr", value)
    assert parse_override("a=1e") == ("a", "1e") and parse_override("a=3") == ("a", 3)


def test_exponent_floats_in_recipe_and_overrides(tmp_path):
    recipe = write_tree(tmp_path, BASE_RECIPE + "algorithm: {clip_low: 2e-1}\n")
    cfg = load_config(recipe, ["actor.optim.lr=1e-3", "actor.optim.weight_decay=1E-2"]).config
    assert cfg.actor.optim.lr == 1e-3 and cfg.actor.optim.weight_decay == 1e-2
    assert cfg.algorithm.clip_low == 0.2


def test_resolved_config_round_trips(tmp_path):
    recipe = write_tree(tmp_path)
    loaded = load_config(recipe, ["trainer.total_steps=7"])
    out = write_resolved_config(loaded, tmp_path / "run")
    text = out.read_text()
    assert "trainer.total_steps=7" in text  # the header records the overrides
    data = yaml.safe_load(text)
    assert data["trainer"]["total_steps"] == 7 and data["model"]["name"] == "tiny-llama"
    # The resolved file alone reproduces the same config.
    assert load_config(out).config == loaded.config


def test_algorithm_names_resolve_in_the_registry(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: unknown advantage estimator 'grp'"):
        load_config(recipe, ["algorithm.adv_estimator=grp"])
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss: unknown policy loss 'clip_hi'"):
        load_config(recipe, ["algorithm.policy_loss=clip_hi"])
    cfg = load_config(recipe, ["algorithm.adv_estimator=rloo"]).config
    assert cfg.algorithm.kl_apply_to == "reward" and cfg.algorithm.kl_estimator == "k1"
    cfg = load_config(recipe).config  # grpo puts its KL in the loss, estimated with k3
    assert cfg.algorithm.kl_apply_to == "loss" and cfg.algorithm.kl_estimator == "k3"


def test_overlong_buffer_must_fit_the_response(tmp_path):
    recipe = write_tree(tmp_path)
    pattern = r"algorithm\.overlong_buffer_length: 99 exceeds rollout\.max_new_tokens"
    with pytest.raises(ConfigError, match=pattern):
        load_config(recipe, ["algorithm.overlong_buffer_length=99"])


def test_colocated_critic_shares_the_actor_layout(tmp_path):
    recipe = write_tree(tmp_path)
    base = ["algorithm.adv_estimator=gae", "critic.enabled=true"]
    layout = r"critic\.parallel: a colocated critic uses the actor's layout tp=2"
    with pytest.raises(ConfigError, match=layout):
        load_config(recipe, [*base, "critic.parallel.tp=1", "critic.parallel.dp=2"])
    cfg = load_config(recipe, [*base, "critic.parallel.tp=2"]).config
    assert cfg.critic_enabled


def test_own_pools_add_their_ranks_after_the_actors(tmp_path):
    from rl3d.config.pools import hosting, pool_of, role_pools

    recipe = write_tree(tmp_path)
    base = ["algorithm.adv_estimator=gae", "critic.enabled=true", "critic.colocate=false"]
    base += ["critic.parallel.tp=1", "critic.parallel.dp=2"]
    world = r"does not match actor p\*t\*d = 1\*2\*1 = 2 \+ critic p\*t\*d = 1\*1\*2 = 2"
    with pytest.raises(ConfigError, match=r"launch\.nproc_per_node: .*" + world):
        load_config(recipe, base)
    cfg = load_config(recipe, [*base, "launch.nproc_per_node=4"]).config
    pools = role_pools(cfg)
    assert [(p.name, list(p.ranks), p.roles) for p in pools] == [
        ("actor", [0, 1], ("actor",)),
        ("critic", [2, 3], ("critic",)),
    ]
    assert pool_of(pools, 3).name == "critic" and hosting(pools, "actor").offset == 0
    ref = ["reference.enabled=true", "reference.colocate=false", "reference.parallel.tp=2"]
    cfg = load_config(recipe, [*base, *ref, "launch.nproc_per_node=6"]).config
    assert [(p.name, list(p.ranks)) for p in role_pools(cfg)][2] == ("reference", [4, 5])
    with pytest.raises(ConfigError, match=r"reference\.parallel\.tp: tp=3 must divide"):
        load_config(recipe, [*base, *ref[:2], "reference.parallel.tp=3", "launch.nproc_per_node=7"])
    with pytest.raises(ConfigError, match=r"reference\.parallel\.dp: dp=3 must divide the step's"):
        load_config(recipe, [*base, *ref[:2], "reference.parallel.dp=3", "launch.nproc_per_node=7"])


def test_baseline_strategies_are_for_the_benchmark_only(tmp_path):
    recipe = write_tree(tmp_path)
    with pytest.raises(ConfigError, match=r"hybrid_engine\.strategy: 'ds_chat' is a baseline"):
        load_config(recipe, ["hybrid_engine.strategy=ds_chat"])


def test_a_renamed_key_loads_as_its_new_name_with_a_warning(tmp_path, caplog):
    """`algorithm.kl.placement` (before "placement" meant only where generation runs) is
    `algorithm.kl.apply_to`: it still loads, warning with the new key; setting both is refused."""
    recipe = write_tree(tmp_path)
    with caplog.at_level("WARNING", logger="rl3d.config.renames"):
        cfg = load_config(recipe, ["algorithm.kl.placement=reward"]).config
    assert cfg.algorithm.kl.apply_to == "reward" and cfg.algorithm.kl_apply_to == "reward"
    assert "algorithm.kl.placement is deprecated: write algorithm.kl.apply_to" in caplog.text
    with pytest.raises(
        ConfigError, match=r"algorithm\.kl\.placement: the former name of algorithm\.kl\.apply_to"
    ):
        load_config(recipe, ["algorithm.kl.placement=reward", "algorithm.kl.apply_to=loss"])
