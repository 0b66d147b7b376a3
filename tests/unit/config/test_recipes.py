"""Every shipped recipe validates, through the real `rl3d validate` command."""

from pathlib import Path

import pytest

import yaml
from rl3d.cli import main
from rl3d.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
REAL_MODEL_RECIPE = "quickstart_cpu_smollm2_gsm8k"


def _inputs(recipe: Path, request, tmp_path: Path) -> list[str]:
    """Overrides for what a recipe needs that `make` makes: the real-model quickstart names the
    fetched SmolLM2 (fetched here, or the test skips) and problems `make quickstart-smollm2`
    writes (written into `tmp_path` here)."""
    if recipe.stem != REAL_MODEL_RECIPE:
        return []
    request.getfixturevalue("smollm2_dir")
    from rl3d.data import gsm8k_synth

    assert gsm8k_synth.main(["--out", str(tmp_path), "--num-train", "8", "--num-val", "4"]) == 0
    return [f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files=[{tmp_path}/val.parquet]"]


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"quickstart_cpu_grpo.yaml", "quickstart_cpu_ppo.yaml"} <= names
    assert any("7b" in n for n in names) and any("70b" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_rl3d_validate_accepts_recipe(recipe, capsys, request, tmp_path):
    overrides = _inputs(recipe, request, tmp_path)
    assert main(["validate", str(recipe), *overrides]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    cfg = load_config(recipe, overrides).config
    assert printed["model"]["name"] == cfg.model.name
    if printed.get("job") == "reward_model":  # a reward-model training job (rl3d.controller.rm_train)
        assert printed["parallel"]["tp"] == cfg.parallel.tp
        return
    assert printed["actor"]["parallel"]["tp"] == cfg.actor.parallel.tp


def test_cpu_quickstart_reshards_every_step():
    cfg = load_config(ROOT / "recipes/quickstart_cpu_grpo.yaml").config
    assert cfg.actor.parallel.tp == 2 and cfg.rollout.t_g == 1  # a real micro-DP group of 2
    assert cfg.rollout.engine == "torch" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.launch.world_size == 2


def test_ppo_quickstart_has_a_critic():
    cfg = load_config(ROOT / "recipes/quickstart_cpu_ppo.yaml").config
    assert cfg.critic_enabled and cfg.algorithm.adv_estimator == "gae"


@pytest.mark.parametrize("block", sorted((ROOT / "yaml").rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_block_is_a_mapping(block):
    assert isinstance(yaml.safe_load(block.read_text()), dict)


@pytest.mark.parametrize("algo", sorted(p.stem for p in (ROOT / "yaml/algos").glob("*.yaml")))
def test_every_algorithm_block_composes_into_a_valid_recipe(algo, tmp_path, monkeypatch):
    monkeypatch.setenv("RL3D_YAML_DIR", str(ROOT / "yaml"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "defaults: [models/tiny_llama, algos/" + algo + ", rollout/torch_cpu, clusters/local_cpu]\n"
        "actor: {parallel: {tp: 2}, mini_batch_size: 8, micro_batch_size: 4}\n"
        "critic: {parallel: {tp: 2}, mini_batch_size: 8, micro_batch_size: 4}\n"
        "data: {synthetic: {task: copy_first}, prompts_per_step: 8}\n"
        "launch: {nproc_per_node: 2}\n"
    )
    if algo == "safe_rlhf":  # trains against a cost, which the recipe must name
        with pytest.raises(ConfigError, match=r"reward\.cost_fn: 'safe_rlhf' trains against a cost"):
            load_config(recipe)
        with pytest.raises(
            ConfigError, match=r"reward\.cost_fn: unknown cost 'high_token_id'.*high_token_ids"
        ):
            load_config(recipe, ["reward.cost_fn=high_token_id"])
        cfg = load_config(recipe, ["reward.cost_fn=high_token_ids"]).config
        assert cfg.critic_enabled and cfg.algorithm.family.needs_cost_critic
        return
    cfg = load_config(recipe).config
    assert cfg.algorithm.adv_estimator in {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax"}
    assert cfg.critic_enabled == cfg.algorithm.family.needs_critic or cfg.critic.enabled
