"""GPG's batch-level corrections: advantages times B / (B - M) (preset on with `policy_loss: gpg`,
off by its key), and the threshold on the valid share that rolls out further rounds."""

import pytest
import torch

from rl3d.algos import Algorithm
from rl3d.config import AlgorithmConfig
from rl3d.config.errors import FieldError
from rl3d.config.policy_loss import PolicyLossParams
from rl3d.single_controller import DataBatch


def _batch(scores, uids, length=3):
    B = len(scores)
    return DataBatch(
        {
            "score": torch.tensor(scores),
            "uid": torch.tensor(uids),
            "response_mask": torch.ones(B, length, dtype=torch.bool),
        }
    )


def _advantages(cfg, batch):
    return Algorithm(cfg).advantages(batch, kl_coef=0.0, max_response_length=3)


def test_gpg_rescales_the_advantages_by_batch_over_valid_samples():
    # groups: {1, 0} valid; {1, 1} and {0, 0} have no spread: B = 6, M = 4, alpha = 6 / 2 = 3
    scores, uids = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1, 1, 2, 2, 3, 3]
    cfg = AlgorithmConfig(policy_loss="gpg", norm_adv_by_std=False)
    batch, metrics = _advantages(cfg, _batch(scores, uids))
    # group mean baseline, no std: +-0.5 in the valid group, times 3
    want = torch.tensor([1.5, -1.5, 0.0, 0.0, 0.0, 0.0])[:, None].expand(6, 3)
    assert torch.equal(batch["advantages"], want) and torch.equal(batch["returns"], want)
    assert metrics["adv/gpg_alpha"] == 3.0 and metrics["adv/valid_share"] == pytest.approx(1 / 3)

    no_rescale = PolicyLossParams(gpg_rescale=False)
    off = AlgorithmConfig(policy_loss="gpg", norm_adv_by_std=False, loss_params=no_rescale)
    batch, metrics = _advantages(off, _batch(scores, uids))
    assert torch.equal(batch["advantages"], want / 3) and "adv/gpg_alpha" not in metrics


def test_gpg_alpha_is_one_without_degenerate_groups_and_when_all_are():
    cfg = AlgorithmConfig(policy_loss="gpg")
    _, metrics = _advantages(cfg, _batch([1.0, 0.0, 0.0, 1.0], [1, 1, 2, 2]))
    assert metrics["adv/gpg_alpha"] == 1.0
    batch, metrics = _advantages(cfg, _batch([1.0, 1.0, 0.0, 0.0], [1, 1, 2, 2]))
    assert metrics["adv/gpg_alpha"] == 1.0 and metrics["adv/valid_share"] == 0.0
    assert not batch["advantages"].any()


def test_gpg_keys_are_refused_by_other_losses_and_checked():
    with pytest.raises(FieldError) as info:
        AlgorithmConfig(policy_loss="ppo", loss_params=PolicyLossParams(gpg_rescale=False))
    assert info.value.field == "loss_params.gpg_rescale"
    with pytest.raises(FieldError, match="gpg_threshold"):
        PolicyLossParams(gpg_threshold=1.5)
    hooks = lambda cfg: [type(h).__name__ for h in Algorithm(cfg).hooks]  # noqa: E731
    assert hooks(AlgorithmConfig(policy_loss="gpg")) == ["GPGRescale"]
    assert hooks(AlgorithmConfig(policy_loss="ppo")) == []
    both = AlgorithmConfig(policy_loss="gpg", loss_params=PolicyLossParams(gpg_threshold=0.6))
    assert hooks(both) == ["GPGRescale", "GPGThreshold"] and Algorithm(both).max_rounds == 8


def test_gpg_threshold_rolls_out_until_the_valid_share_is_reached():
    algo = Algorithm(AlgorithmConfig(policy_loss="gpg", loss_params=PolicyLossParams(gpg_threshold=0.6)))
    algo.begin_step()
    # 5 prompts a round, 2 samples each; round 1: groups 1 and 3 valid (2 < 0.6 * 5): only they stay
    first = _batch([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    assert algo.keep(first)["uid"].tolist() == [1, 1, 3, 3]
    # round 2: group 8 valid, 2 + 1 >= 3: its valid group first, then its zero-spread ones fill in
    second = _batch([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], [6, 6, 7, 7, 8, 8, 9, 9, 10, 10])
    assert algo.keep(second)["uid"].tolist() == [8, 8, 6, 6, 7, 7, 9, 9, 10, 10]
    # the next step counts afresh
    algo.begin_step()
    assert algo.keep(first)["uid"].tolist() == [1, 1, 3, 3]
