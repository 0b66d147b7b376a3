"""Registry names, lookups, did-you-mean errors and the controller-facing AlgorithmFamily flags."""

import pytest
import torch

from rl3d import algos
from rl3d.algos.registry import Registry


def test_registries_list_every_name():
    assert algos.ADVANTAGE_ESTIMATORS.names() == (
        "gae",
        "grpo",
        "on_policy_distillation",
        "reinforce_plus_plus",
        "remax",
        "rloo",
        "safe_rlhf",
    )
    assert algos.POLICY_LOSSES.names() == (
        "cispo",
        "clip_cov",
        "clip_higher",
        "dual_clip",
        "gmpo",
        "gpg",
        "gspo",
        "kl_cov",
        "ppo",
        "sapo",
    )
    assert algos.LOSS_AGG_MODES.names() == ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean")
    assert algos.KL_ESTIMATORS.names() == ("k1", "k2", "k3")
    assert algos.KL_CONTROLLERS.names() == ("adaptive", "fixed")


@pytest.mark.parametrize(
    ("getter", "name", "kind", "suggestion"),
    [
        (algos.get_advantage_estimator, "grp", "advantage estimator", "grpo"),
        (algos.get_policy_loss, "dual-clip", "policy loss", "dual_clip"),
        (algos.get_loss_agg_mode, "token_mean", "loss aggregation mode", "token-mean"),
        (algos.get_kl_estimator, "k33", "KL estimator", "k3"),
        (algos.get_kl_controller, "adaptiv", "KL controller", "adaptive"),
    ],
)
def test_unknown_name_is_value_error_with_suggestion(getter, name, kind, suggestion):
    with pytest.raises(ValueError) as info:
        getter(name)
    message = str(info.value)
    assert message.startswith(f"unknown {kind} {name!r} (did you mean {suggestion!r}?)")
    assert "known: " in message


def test_unknown_name_without_close_match_lists_known_names():
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'xyzzy'; known: gae, grpo"):
        algos.get_advantage_estimator("xyzzy")


def test_registering_a_name_twice_is_an_internal_error():
    registry: Registry[int] = Registry("thing")
    registry.register("a", 1)
    assert registry.get("a") == 1 and "a" in registry and len(registry) == 1
    with pytest.raises(AssertionError):
        registry.register("a", 2)


def test_algorithm_family_flags_tell_the_controller_what_to_build():
    flags = {
        name: (
            family.needs_critic,
            family.needs_group_samples,
            family.needs_greedy_baseline,
            family.needs_cost_critic,
            family.needs_teacher,
        )
        for name, family in ((n, algos.get_advantage_estimator(n)) for n in algos.ADVANTAGE_ESTIMATORS)
    }
    assert flags == {
        "gae": (True, False, False, False, False),
        "grpo": (False, True, False, False, False),
        "rloo": (False, True, False, False, False),
        "reinforce_plus_plus": (False, False, False, False, False),
        "remax": (False, False, True, False, False),
        "safe_rlhf": (True, False, False, True, False),
        "on_policy_distillation": (False, False, False, False, True),
    }
    assert algos.get_advantage_estimator("grpo").default_kl_apply_to == "loss"
    assert algos.get_advantage_estimator("gae").default_kl_apply_to == "reward"


def test_each_estimator_names_the_batch_columns_the_stage_must_find():
    built_in = ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax", "safe_rlhf", "on_policy_distillation")
    columns = {name: algos.get_advantage_estimator(name).columns for name in built_in}
    assert columns == {
        "gae": ("values",),
        "grpo": ("uid",),
        "rloo": ("uid",),
        "reinforce_plus_plus": (),
        "remax": ("greedy_score",),
        "safe_rlhf": ("values", "cost", "cost_values"),
        "on_policy_distillation": ("old_logp", "teacher_logp"),
    }
    assert algos.get_advantage_estimator("on_policy_distillation").optional_inputs == ("group_ids_B",)


def test_policy_loss_presets_differ_only_in_defaults():
    ones = torch.ones(1, 1)
    # ratio 2 with A = -1: ppo clips to 1.2 (loss 2 from the unclipped side), dual clip caps at c.
    logp = torch.log(torch.tensor([[2.0]]))
    args = dict(logp_BT=logp, old_logp_BT=torch.zeros(1, 1), mask_BT=ones.bool())
    ppo, _ = algos.get_policy_loss("ppo")(adv_BT=-ones, **args)
    dual, _ = algos.get_policy_loss("dual_clip")(adv_BT=-ones, dual_clip_c=1.5, **args)
    higher, _ = algos.get_policy_loss("clip_higher")(adv_BT=ones, **args)
    assert ppo.item() == pytest.approx(2.0)
    assert dual.item() == pytest.approx(1.5)
    assert higher.item() == pytest.approx(-1.28)


def test_compute_advantages_dispatches_and_checks_inputs():
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    out = algos.compute_advantages("rloo", rewards_BT=rewards, mask_BT=mask, group_ids_B=torch.tensor([5, 5]))
    torch.testing.assert_close(out.adv_BT, torch.tensor([[-2.0, -2.0], [2.0, 2.0]]))
    with pytest.raises(ValueError, match="'gae' needs values_BT"):
        algos.compute_advantages("gae", rewards_BT=rewards, mask_BT=mask)
    with pytest.raises(ValueError, match="'remax' needs greedy_scores_B"):
        algos.compute_advantages("remax", rewards_BT=rewards, mask_BT=mask)
    out = algos.compute_advantages(
        "gae", rewards_BT=rewards, mask_BT=mask, values_BT=torch.zeros(2, 2), whiten=False, gamma=0.5
    )
    torch.testing.assert_close(out.returns_BT, torch.tensor([[0.5, 1.0], [1.5, 3.0]]))
