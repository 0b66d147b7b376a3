"""`algorithm.routing_replay`: default none (a run as before), and each setting a record cannot
pass through refused with the key that must change."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
MOE = ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 1, pp: 1, dp: 2}"]


def test_default_is_none_and_the_modes_load():
    assert load_config(GRPO).config.algorithm.routing_replay == "none"
    for mode in ("rollout", "old"):
        overrides = [*MOE, f"algorithm.routing_replay={mode}", "actor.recompute_old_logp=always"]
        assert load_config(GRPO, overrides).config.algorithm.routing_replay == mode


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.routing_replay=rollout"], r"algorithm\.routing_replay: .* tiny-llama is dense"),
        ([*MOE, "algorithm.routing_replay=sometimes"], r"algorithm\.routing_replay"),
        (
            [*MOE, "algorithm.routing_replay=old", "actor.recompute_old_logp=never"],
            r"actor\.recompute_old_logp: .*'old' records the routing in the old-log-prob forward",
        ),
        (
            # one update over all samples: `auto` skips the old-log-prob forward
            [*MOE, "algorithm.routing_replay=old", "actor.mini_batch_size=32"],
            r"actor\.recompute_old_logp: ",
        ),
        (
            [*MOE, "algorithm.routing_replay=rollout", "actor.recompute=full"],
            r"actor\.recompute: 'full' reruns the routers in the backward",
        ),
        (
            [*MOE, "algorithm.routing_replay=rollout", "rollout.agent.kind=tool_loop"],
            r"rollout\.agent\.kind: .*no one routing record",
        ),
    ],
    ids=["dense", "unknown", "old-without-old-forward", "old-auto-skips", "recompute", "multi-turn"],
)
def test_bad_settings_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, overrides)


def test_a_separate_rollout_pool_takes_the_engines_record():
    """Its rows carry the record (tests/e2e/test_routing_replay_async_e2e.py), stale ones too."""
    recipe = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
    for staleness in (0, 1):
        cfg = load_config(
            recipe,
            [
                "model.name=tiny-qwen3-moe",
                "algorithm.routing_replay=rollout",
                f"rollout.async.max_staleness={staleness}",
            ],
        ).config
        assert (cfg.rollout.placement, cfg.algorithm.routing_replay) == ("separate", "rollout")
