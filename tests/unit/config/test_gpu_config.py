"""The GPU path's keys: `<role>.offload`, and what the SGLang engine refuses at validation."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
GRPO, PPO = ROOT / "recipes/quickstart_cpu_grpo.yaml", ROOT / "recipes/quickstart_cpu_ppo.yaml"
GPU_7B = ROOT / "recipes/gpu_llama2_7b_grpo.yaml"


def test_offload_lists_are_typed_and_default_to_nothing():
    cfg = load_config(PPO, ["critic.offload=[params,grads,optimizer]", "reference.offload=[params]"]).config
    assert cfg.actor.offload == []
    assert cfg.critic.offload == ["params", "grads", "optimizer"]
    assert cfg.reference.offload == ["params"]
    assert load_config(GPU_7B, ["actor.offload=[params,grads,optimizer]"]).config.actor.offload == [
        "params",
        "grads",
        "optimizer",
    ]


@pytest.mark.parametrize(
    "override, match",
    [
        ("actor.offload=[weights]", r"actor\.offload"),
        ("critic.offload=[grads,grads]", r"critic\.offload: lists an entry twice"),
        ("reference.offload=[optimizer]", r"reference\.offload: \['optimizer'\]: the reference is frozen"),
        ("actor.offload=[params]", r"actor\.offload: 'params' with rollout\.engine=torch"),
    ],
)
def test_bad_offload_names_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PPO, [override])


def test_offload_of_a_role_off_the_generating_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"critic\.offload: \['grads'\]: offload happens around generation"):
        load_config(PPO, ["critic.offload=[grads]", "critic.colocate=false", "launch.nproc_per_node=4"])
    with pytest.raises(ConfigError, match=r"reference\.offload"):
        load_config(GRPO, ["reference.offload=[params]", "reference.enabled=false", "algorithm.kl.coef=0"])


def test_ray_with_sglang_across_gpus_is_refused():
    ok = load_config(GPU_7B, ["launch.backend=spmd"]).config
    assert ok.rollout.t_g == 2
    with pytest.raises(
        ConfigError, match=r"rollout\.t_g: t_g=2 with rollout\.engine=sglang needs launch\.backend=spmd"
    ):
        load_config(GPU_7B, ["launch.backend=ray"])
    assert load_config(GPU_7B, ["launch.backend=ray", "rollout.t_g=1"]).config.rollout.t_g == 1


def test_distributed_weight_update_is_refused_until_it_works():
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.weight_update: 'distributed' is not supported"):
        load_config(GPU_7B, ["rollout.sglang.weight_update=distributed"])


def test_sglang_deterministic_inference_is_opt_in():
    assert load_config(GPU_7B).config.rollout.sglang.deterministic is False
    assert load_config(GPU_7B, ["rollout.sglang.deterministic=true"]).config.rollout.sglang.deterministic
