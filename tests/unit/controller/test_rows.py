"""A step with more rows than prompts x n (an agent's extra samples): padded with empty rows to
a count the training layout deals evenly, its mini-batches scaled so a step makes the recipe's
number of optimizer updates, and the padding outside the loss and the group statistics."""

import pytest
import torch

from rl3d.algos.advantages import compute_advantages
from rl3d.algos.core import scores_to_token_rewards
from rl3d.config import load_config
from rl3d.controller.rows import PAD_GROUP, fit_rows, one_row_per_sample, row_multiple
from rl3d.single_controller.batch import NOMINAL_ROWS, DataBatch, mini_batch_rows
from rl3d.single_controller.dispatch import MODES, Dispatch, DispatchInfo

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_agent.yaml"
# 8 prompts x 4 samples; one mini-batch of 32 over dp 2 in micro-batches of 8: a multiple of 16
DP2 = ["actor.parallel.tp=1", "actor.parallel.dp=2", "actor.micro_batch_size=8"]


def _rows(groups: list[int], seed: int = 0) -> DataBatch:
    """One row per entry (its prompt's uid), with a random score and response length."""
    gen = torch.Generator().manual_seed(seed)
    B, R = len(groups), 6
    lengths = torch.randint(1, R + 1, (B,), generator=gen)
    mask = (torch.arange(R) < lengths[:, None]).long()
    return DataBatch(
        {
            "uid": torch.tensor(groups),
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones(B, 2, dtype=torch.long), mask], 1),
            "score": torch.rand(B, generator=gen),
        },
        {"finish_reason": ["stop"] * B},
    )


@pytest.fixture(scope="module")
def cfg():
    return load_config(RECIPE, DP2).config


def test_a_step_of_prompts_x_n_rows_is_left_as_it_is(cfg):
    batch = _rows([p for p in range(8) for _ in range(4)])
    fitted, num_rows = fit_rows(batch, cfg)
    assert fitted is batch and num_rows == 32 and NOMINAL_ROWS not in fitted.info


@pytest.mark.parametrize("extra, padded", [(5, 48), (15, 64)])  # 47 rows: one pad row would be a group of one
def test_extra_rows_are_padded_to_what_the_layout_deals(cfg, extra, padded):
    assert row_multiple(cfg) == 16
    groups = [p for p in range(8) for _ in range(4)] + [p % 8 for p in range(extra)]
    batch = _rows(sorted(groups))
    fitted, num_rows = fit_rows(batch, cfg)
    assert num_rows == 32 + extra and len(fitted) == padded and fitted.info[NOMINAL_ROWS] == 32
    pad = fitted.slice(num_rows, padded)
    assert (pad["response_mask"] == 0).all() and (pad["uid"] == PAD_GROUP).all()
    assert torch.equal(fitted.slice(0, num_rows)["score"], batch["score"])  # the real rows unchanged

    # GRPO over the padded batch: the real rows' advantages are those of the real rows alone,
    # and the padding (one group of equal scores, no tokens) has none
    def grpo(b):
        rewards = scores_to_token_rewards(b["score"], b["response_mask"])
        return compute_advantages(
            "grpo", rewards_BT=rewards, mask_BT=b["response_mask"], group_ids_B=b["uid"]
        )

    adv = grpo(fitted).adv_BT
    torch.testing.assert_close(adv[:num_rows], grpo(batch).adv_BT, rtol=0, atol=0)
    assert (adv[num_rows:] == 0).all()

    # one mini-batch (the recipe's 32 samples) of all the rows, dealt evenly over the 2 ranks
    mode = MODES[Dispatch.MEGATRON_COMPUTE]
    shares = []
    for rank in range(2):
        slot = mode.slot(DispatchInfo(dp_rank=rank, dp_size=2, is_collector=True, token_balance=32))
        shares.append(mode.split(fitted, slot))
    assert [len(s) for s in shares] == [padded // 2] * 2
    assert sorted(shares[0]["score"].tolist() + shares[1]["score"].tolist()) == sorted(
        fitted["score"].tolist()
    )
    # a rank's train_minibatches: its share is one mini-batch, in micro-batches of 8
    local = mini_batch_rows(32, shares[0].info, len(shares[0]) * 2) // 2
    assert local == padded // 2 and local % 8 == 0


def test_mini_batches_scale_with_the_rows():
    assert mini_batch_rows(8, {}, 48) == 8  # the nominal batch: the recipe's mini-batch
    assert mini_batch_rows(8, {NOMINAL_ROWS: 32}, 48) == 12  # 4 mini-batches, as over 32 samples


def test_validation_counts_a_session_once():
    batch = _rows([0, 0, 0, 1])
    records = [{"agent": {"session": s}} for s in ("0-0", "0-0", "0-1", "1-0")]
    batch.set("trajectory", records)
    once = one_row_per_sample(batch)
    assert [r["agent"]["session"] for r in once["trajectory"]] == ["0-0", "0-1", "1-0"]
    assert torch.equal(once["score"], batch["score"][[0, 2, 3]])
    plain = _rows([0, 0])
    assert one_row_per_sample(plain) is plain  # not an agent rollout
