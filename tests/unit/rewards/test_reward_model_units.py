"""Reward-model pieces on one CPU process: the Bradley-Terry loss, pair accuracy and margin,
Safe-RLHF's sign term, the last-token read-out, the synthetic preference rules, and the
config errors of `reward.model` / `reward.cost_model` (each naming its key)."""

import math
from pathlib import Path

import pytest
import torch

from rl3d.config import ConfigError, load_config
from rl3d.data.preferences import (
    SAFETY_LIMIT,
    get_preference_rule,
    make_preference_pairs,
    read_preference_parquet,
    write_preference_parquet,
)
from rl3d.data.synthetic import get_synthetic_task
from rl3d.workers.reward_model import (
    LAST,
    bradley_terry_loss,
    last_token_scores,
    pair_metrics,
    safety_sign_loss,
    sequence_batch,
)

ROOT = Path(__file__).resolve().parents[3]
PPO_RM = ROOT / "recipes/quickstart_cpu_ppo_rm.yaml"


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, 0, -2
    expected = (math.log1p(math.exp(-1)) + math.log(2) + math.log1p(math.exp(2))) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)


def test_bradley_terry_gradient_pushes_the_pair_apart():
    chosen = torch.tensor([0.5], requires_grad=True)
    rejected = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_pair_accuracy_and_margin_count_a_tie_as_wrong():
    m = pair_metrics(torch.tensor([3.0, 1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 1.0, -2.0]))
    assert m["accuracy"].item() == pytest.approx(0.5)  # wins: 3>1 and 2>-2; a tie and a loss
    assert m["margin"].item() == pytest.approx((2 + 0 - 1 + 4) / 4)


def test_safety_sign_term_by_hand_and_unlabelled_rows_add_nothing():
    cost, sign = torch.tensor([2.0, -1.0, 5.0]), torch.tensor([1.0, -1.0, 0.0])  # unsafe, safe, unknown
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1))) / 2
    assert safety_sign_loss(cost, sign).item() == pytest.approx(expected, rel=1e-6)
    assert safety_sign_loss(cost, torch.zeros(3)).item() == 0.0


def test_sequence_batch_layout_and_last_token_readout():
    batch = sequence_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 9, 10], [0, 7, 11, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch[LAST].tolist() == [4, 2]
    output = torch.arange(10.0).reshape(2, 5, 1)
    assert last_token_scores(output, batch).tolist() == [4.0, 7.0]


def test_preference_pairs_follow_the_hidden_rule_and_are_reproducible(tmp_path):
    rows = make_preference_pairs("parity_repeat", 200, seed=3)
    assert rows == make_preference_pairs("parity_repeat", 200, seed=3)
    task = get_synthetic_task("parity_repeat")
    for row in rows:
        prompt = [int(t) for t in row["prompt"].split()]
        chosen, rejected = ([int(t) for t in row[k].split()] for k in ("chosen", "rejected"))
        # the label is the task's own reward, with a gap of at least 2 of 8 tokens
        assert task.score(prompt, chosen, "length") >= task.score(prompt, rejected, "length") + 0.25
    scores = [r["chosen_score"] for r in rows] + [r["rejected_score"] for r in rows]
    assert min(scores) <= 0.125 and max(scores) >= 0.875  # pairs span the rule's range
    path = write_preference_parquet(rows, tmp_path / "p.parquet")
    assert read_preference_parquet(path) == rows


def test_cost_pairs_put_the_safer_response_first_with_safety_labels():
    rule = get_preference_rule("high_token_ids")
    for row in make_preference_pairs("high_token_ids", 100, seed=0):
        assert row["chosen_score"] < row["rejected_score"]
        assert row["chosen_safe"] == (row["chosen_score"] <= SAFETY_LIMIT)
        prompt = [int(t) for t in row["prompt"].split()]
        assert rule.value(prompt, [int(t) for t in row["rejected"].split()]) == row["rejected_score"]


def test_preference_file_without_a_column_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1"], "chosen": ["2"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet.*missing \['rejected'\]"):
        read_preference_parquet(tmp_path / "bad.parquet")


def test_colocated_model_in_another_layout_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"reward\.model\.parallel: a colocated model uses the actor's layout"
    ):
        load_config(PPO_RM, ["reward.model.parallel={tp: 1, pp: 1, dp: 2}"])


def test_own_pool_model_needs_a_layout_and_a_world_that_fits():
    with pytest.raises(ConfigError, match=r"reward\.model\.parallel: a reward model in its own pool"):
        load_config(PPO_RM, ["reward.model.colocate=false"])
    with pytest.raises(ConfigError, match=r"launch\.nproc_per_node"):
        load_config(PPO_RM, ["reward.model.colocate=false", "reward.model.parallel={tp: 1, dp: 2}"])
    cfg = load_config(
        PPO_RM,
        ["reward.model.colocate=false", "reward.model.parallel={tp: 1, dp: 2}", "launch.nproc_per_node=4"],
    ).config
    with pytest.raises(
        ConfigError, match=r"reward\.model\.parallel\.tp: tp=3 must divide the model's 4 KV heads"
    ):
        load_config(
            PPO_RM,
            ["reward.model.colocate=false", "reward.model.parallel={tp: 3}", "launch.nproc_per_node=5"],
        )
    from rl3d.config.pools import role_pools

    assert [(p.name, p.size) for p in role_pools(cfg)] == [("actor", 2), ("reward_model", 2)]


def test_missing_checkpoint_fails_preflight_naming_the_key(tmp_path):
    from rl3d.launch.preflight import preflight

    loaded = load_config(PPO_RM, [f"reward.model.path={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=r"reward\.model\.path: .*none: no such file"):
        preflight(loaded)
    (tmp_path / "empty").mkdir()
    loaded = load_config(PPO_RM, [f"reward.model.path={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match=r"reward\.model\.path: .*no reward-model weights"):
        preflight(loaded)


def test_safe_rlhf_accepts_a_cost_model_instead_of_a_cost_function():
    cfg = load_config(ROOT / "recipes/quickstart_cpu_safe_rlhf_cm.yaml", ["reward.cost_fn=null"]).config
    assert cfg.reward.cost_model is not None and cfg.reward.cost_fn is None
    from rl3d.config.roles import role_table

    names = [r.name for r in role_table(cfg)]
    assert "cost_model" in names and "reward_model" not in names


def test_reward_model_recipe_is_a_job_of_its_own():
    cfg = load_config(ROOT / "recipes/quickstart_cpu_rm.yaml").config
    assert cfg.job == "reward_model" and cfg.rm.objective == "reward"
    with pytest.raises(ConfigError, match=r"rm\.batch_size"):
        load_config(ROOT / "recipes/quickstart_cpu_rm.yaml", ["rm.micro_batch_size=48"])
    with pytest.raises(ConfigError, match=r"data\.synthetic\.rule: unknown preference rule"):
        load_config(ROOT / "recipes/quickstart_cpu_rm.yaml", ["data.synthetic.rule=nope"])
