"""`actor.log_prob_micro_batch_size`: how many samples a forward-only micro-batch takes."""

import pytest

from rl3d.config import load_config
from rl3d.config.errors import ConfigError
from rl3d.engine import forward_micro_batch

RECIPE = "recipes/quickstart_cpu_grpo.yaml"  # micro_batch_size 8, 32 samples a step; sets it to 32


def actor(*overrides):
    return load_config(RECIPE, list(overrides)).config.actor


def test_unset_keeps_the_training_micro_batch():
    unset = actor("actor.log_prob_micro_batch_size=null")
    assert unset.log_prob_micro_batch_size is None
    assert [forward_micro_batch(unset, rows) for rows in (32, 12, 5)] == [8, 8, 8]
    assert forward_micro_batch(actor(), 32) == 32  # the demo's


@pytest.mark.parametrize(
    ("cap", "rows", "expected"),
    [(32, 32, 32), (64, 32, 32), (16, 32, 16), (24, 32, 16), (12, 30, 10), (7, 13, 1), (4, 0, 4)],
)
def test_the_largest_count_up_to_the_cap_that_divides_the_rows(cap, rows, expected):
    got = forward_micro_batch(actor(f"actor.log_prob_micro_batch_size={cap}"), rows)
    assert got == expected
    assert rows == 0 or rows % got == 0  # equal micro-batches


def test_a_cap_below_one_names_the_key():
    with pytest.raises(ConfigError, match=r"actor\.log_prob_micro_batch_size: must be > 0"):
        actor("actor.log_prob_micro_batch_size=0")


def test_the_memory_plan_counts_the_reference_forward_at_the_cap():
    from rl3d.planning.memory_roles import role_model

    def planned(*overrides):
        cfg = load_config(RECIPE, list(overrides)).config
        return role_model(cfg, "reference").micro_batch_size, role_model(cfg, "actor").micro_batch_size

    assert planned() == (32, 8)  # the demo's forward cap; the actor's plan is its training micro-batches
    assert planned("actor.log_prob_micro_batch_size=null") == (8, 8)
