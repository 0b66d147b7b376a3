"""The algorithm object: the recipe's policy loss is the one that runs, and each algorithm's
special case is a hook, selected by name, that does what the algorithm says."""

import pytest
import torch

from rl3d import algos
from rl3d.algos import HOOKS, Algorithm, AlgorithmHook, policy_loss_of, ppo_policy_loss
from rl3d.algos.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from rl3d.config import AlgorithmConfig
from rl3d.config.schema import SafeRLHFConfig
from rl3d.single_controller import DataBatch


def loss_inputs():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=gen) * 0.1 - 1.0
    old = logp + torch.randn(4, 5, generator=gen) * 0.5  # ratios far outside any clip
    old[3] = logp[3] - 2.0  # ratio e^2 > 3 on a negative advantage: where the dual clip bites
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5, [2.0] * 5, [-3.0] * 5])
    return {"logp_BT": logp, "old_logp_BT": old, "adv_BT": adv, "mask_BT": torch.ones(4, 5, dtype=torch.bool)}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ppo", {"clip_low": 0.2, "clip_high": None, "dual_clip_c": None}),
        ("dual_clip", {"clip_low": 0.2, "clip_high": None, "dual_clip_c": 3.0}),
        ("clip_higher", {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": None}),
    ],
)
def test_the_recipes_policy_loss_is_the_one_that_runs(name, expected):
    x = loss_inputs()
    loss, _ = policy_loss_of(AlgorithmConfig(policy_loss=name))(**x)
    want, _ = ppo_policy_loss(**x, **expected)
    assert torch.equal(loss, want)
    if name != "ppo":  # and it is not PPO's: the name selects something
        plain, _ = ppo_policy_loss(**x)
        assert not torch.equal(loss, plain)


def test_a_recipes_own_clip_wins_over_the_presets():
    x = loss_inputs()
    loss, _ = policy_loss_of(AlgorithmConfig(policy_loss="clip_higher", clip_high=0.4))(**x)
    assert torch.equal(loss, ppo_policy_loss(**x, clip_low=0.2, clip_high=0.4)[0])


def test_each_algorithm_gets_its_hooks():
    kinds = lambda cfg: [type(h).__name__ for h in Algorithm(cfg).hooks]  # noqa: E731
    assert kinds(AlgorithmConfig(adv_estimator="grpo")) == []
    assert kinds(AlgorithmConfig(adv_estimator="remax")) == ["GreedyBaseline"]
    assert kinds(AlgorithmConfig(adv_estimator="safe_rlhf")) == ["Lagrangian"]
    dapo = Algorithm(AlgorithmConfig(adv_estimator="grpo", dynamic_sampling=True))
    assert [type(h).__name__ for h in dapo.hooks] == ["DynamicSampling"] and dapo.max_rounds == 8
    assert Algorithm(AlgorithmConfig()).max_rounds == 1


def scored(scores, uids):
    return DataBatch({"score": torch.tensor(scores), "uid": torch.tensor(uids)})


def test_dynamic_sampling_keeps_only_groups_with_a_reward_spread():
    algo = Algorithm(AlgorithmConfig(adv_estimator="grpo", dynamic_sampling=True))
    kept = algo.keep(scored([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [7, 7, 8, 8, 9, 9]))
    assert kept["uid"].tolist() == [8, 8]


def test_greedy_baseline_scores_one_greedy_response_per_prompt():
    algo = Algorithm(AlgorithmConfig(adv_estimator="remax"))
    calls = []

    def rollout(prompts, **sampling):
        calls.append(sampling)
        return scored([0.25, 0.75], [1, 2])

    batch = algo.on_rollout(
        scored([1.0, 0.0, 1.0], [2, 1, 2]), DataBatch({"uid": torch.tensor([1, 2])}), rollout
    )
    assert calls == [{"greedy": True}]
    assert batch["greedy_score"].tolist() == [0.75, 0.25, 0.75]


def test_lagrangian_feeds_the_advantages_steps_after_the_update_and_checkpoints():
    cfg = AlgorithmConfig(
        adv_estimator="safe_rlhf",
        safe_rlhf=SafeRLHFConfig(cost_threshold=0.1, lagrange_init=1.0, lagrange_lr=0.5),
    )
    algo = Algorithm(cfg)
    assert algo.hooks[0].advantage_args() == {"lagrange_multiplier": 1.0}
    metrics = algo.after_update(DataBatch({"cost": torch.tensor([1.0, 1.0])}))
    assert metrics["safe/lambda"] == 1.0 and metrics["safe/lambda_next"] > 1.0  # cost above threshold
    again = Algorithm(cfg)
    again.load_state_dict(algo.state_dict())
    assert again.hooks[0].advantage_args() == {"lagrange_multiplier": metrics["safe/lambda_next"]}


def test_a_new_algorithm_is_an_estimator_and_a_hook_by_name():
    class ClipScores(AlgorithmHook):
        def __init__(self, cfg):
            pass

        def on_rollout(self, batch, prompts, rollout):
            return batch.set("score", batch["score"].clamp(max=0.5))

    HOOKS.register("clip_scores_test", ClipScores)
    register_advantage_estimator("grpo_clipped_test", needs_critic=False, hooks=("clip_scores_test",))(
        algos.grpo_advantages
    )
    try:
        algo = Algorithm(AlgorithmConfig(adv_estimator="grpo_clipped_test"))
        out = algo.on_rollout(scored([1.0, 0.0], [1, 1]), DataBatch(), rollout=None)
        assert out["score"].tolist() == [0.5, 0.0]
    finally:
        HOOKS._entries.pop("clip_scores_test")
        ADVANTAGE_ESTIMATORS._entries.pop("grpo_clipped_test")
