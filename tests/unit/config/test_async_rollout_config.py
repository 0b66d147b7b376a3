"""`rollout.placement`, `rollout.pool` and `rollout.async`: parsed (the YAML key `async` is the
field `async_`), placed as the last pool, and every bad combination refused at validation with
the key named."""

import pytest

import yaml
from rl3d.config import ConfigError, load_config
from rl3d.config.pools import role_pools
from rl3d.config.typed import to_dict

ASYNC = "recipes/quickstart_cpu_grpo_async.yaml"
SYNC = "recipes/quickstart_cpu_grpo.yaml"


def test_async_recipe_parses_and_places_the_rollout_pool_last():
    cfg = load_config(
        ASYNC, ["reference.enabled=true", "reference.colocate=false", "launch.nproc_per_node=3"]
    ).config
    assert cfg.rollout.placement == "separate" and cfg.rollout.async_.max_staleness == 1
    pools = role_pools(cfg)
    assert [(p.name, p.offset, p.size) for p in pools] == [
        ("actor", 0, 1),
        ("reference", 1, 1),
        ("rollout", 2, 1),
    ]
    written = to_dict(cfg)["rollout"]
    assert "async" in written and "async_" not in written
    assert written["async"]["max_staleness"] == 1
    yaml.safe_dump(written)  # plain data


def test_ray_backend_takes_a_separate_pool():
    cfg = load_config(ASYNC, ["launch.backend=ray"]).config
    assert cfg.launch.backend == "ray" and cfg.rollout.placement == "separate"
    assert [(p.name, p.offset, p.size) for p in role_pools(cfg)] == [("actor", 0, 1), ("rollout", 1, 1)]
    with pytest.raises(ConfigError) as err:  # the other refusals hold under Ray too
        load_config(ASYNC, ["launch.backend=ray", "rollout.pool.dp=0"])
    assert err.value.key == "rollout.pool.dp"


def test_defaults_keep_the_colocated_loop():
    cfg = load_config(SYNC, []).config
    assert cfg.rollout.placement == "colocated" and cfg.rollout.async_.max_staleness == 0
    assert [p.name for p in role_pools(cfg)] == ["actor"]


@pytest.mark.parametrize(
    "recipe,overrides,key",
    [
        (SYNC, ["rollout.async.max_staleness=1"], "rollout.async.max_staleness"),
        (ASYNC, ["rollout.async.max_staleness=-1"], "rollout.async.max_staleness"),
        (ASYNC, ["rollout.async.bogus=1"], "rollout.async.bogus"),
        (ASYNC, ["rollout.placement=elsewhere"], "rollout.placement"),
        (ASYNC, ["launch.nproc_per_node=3"], "launch.nproc_per_node"),
        (ASYNC, ["rollout.pool.tp=3", "launch.nproc_per_node=4"], "rollout.pool.tp"),
        (ASYNC, ["rollout.pool.dp=0"], "rollout.pool.dp"),
    ],
)
def test_bad_async_settings_name_the_key(recipe, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    assert err.value.key == key, str(err.value)


@pytest.mark.parametrize("backend", ["spmd", "ray"])
@pytest.mark.parametrize(
    "overrides",
    [["algorithm.dynamic_sampling=true"], ["algorithm.adv_estimator=remax"], ["trainer.val_every=2"]],
)
def test_extra_rounds_and_validation_run_on_a_separate_pool(overrides, backend):
    """DAPO's refill rounds, ReMax's greedy round and validation are requests to the pool."""
    cfg = load_config(ASYNC, [*overrides, f"launch.backend={backend}"]).config
    assert cfg.rollout.placement == "separate"


def test_weight_update_is_full_or_delta_on_a_separate_pool():
    assert load_config(ASYNC, []).config.rollout.weight_update == "full"
    cfg = load_config(ASYNC, ["rollout.weight_update=delta"]).config
    assert cfg.rollout.weight_update == "delta"
    from rl3d.config.pools import weight_sync_plan
    from rl3d.models.spec import spec_of

    assert weight_sync_plan(cfg, spec_of(cfg.model)).delta is True
    with pytest.raises(ConfigError) as err:
        load_config(ASYNC, ["rollout.weight_update=deltas"])
    assert err.value.key == "rollout.weight_update" and "did you mean 'delta'" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a colocated rollout sends nothing
        load_config(SYNC, ["rollout.weight_update=delta"])
    assert err.value.key == "rollout.weight_update" and "placement: separate" in str(err.value)


def test_failure_containment_keys_load_on_a_separate_pool():
    cfg = load_config(
        ASYNC,
        [
            "rollout.timeout_s=30",
            "rollout.min_fraction=0.75",
            "rollout.max_restarts=2",
            "rollout.reissue=false",
        ],
    ).config
    ro = cfg.rollout
    assert (ro.timeout_s, ro.min_fraction, ro.max_restarts, ro.reissue) == (30.0, 0.75, 2, False)
    from rl3d.config.async_rollout import contains_failures

    assert contains_failures(cfg) and not contains_failures(load_config(ASYNC, []).config)


@pytest.mark.parametrize(
    "recipe,overrides,key,says",
    [
        (ASYNC, ["rollout.timeout_s=0"], "rollout.timeout_s", "> 0"),
        (ASYNC, ["rollout.timeout_s=30", "rollout.min_fraction=0"], "rollout.min_fraction", "(0, 1]"),
        (ASYNC, ["rollout.timeout_s=30", "rollout.min_fraction=1.5"], "rollout.min_fraction", "(0, 1]"),
        (ASYNC, ["rollout.timeout_s=30", "rollout.max_restarts=-1"], "rollout.max_restarts", ">= 0"),
        (ASYNC, ["rollout.reissue=sometimes"], "rollout.reissue", ""),
        (SYNC, ["rollout.timeout_s=30"], "rollout.timeout_s", "placement: separate"),
        (SYNC, ["rollout.max_restarts=1"], "rollout.max_restarts", "placement: separate"),
        (ASYNC, ["rollout.min_fraction=0.5"], "rollout.min_fraction", "needs rollout.timeout_s"),
        (ASYNC, ["rollout.max_restarts=1"], "rollout.max_restarts", "needs rollout.timeout_s"),
        (
            ASYNC,
            ["rollout.timeout_s=30", "rollout.pool.tp=2", "launch.nproc_per_node=3"],
            "rollout.pool.tp",
            "pool.tp 1",
        ),
    ],
)
def test_bad_failure_containment_settings_name_the_key(recipe, overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    assert err.value.key == key and says in str(err.value), str(err.value)
