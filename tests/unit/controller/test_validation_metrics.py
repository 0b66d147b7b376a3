"""Validation's pieces that need no process group: the pass@k estimator against hand-computed
values, the synthetic validation split, and the `trainer.val_*` config checks."""

import math
from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.validation import validation_samples
from rl3d.controller.validation import mean_pass_at_k, pass_at_k, synthetic_split
from rl3d.data import load_prompt_dataset, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 is the pass rate
        (4, 3, 1, 0.75),
        (4, 1, 4, 1.0),  # one pass among all 4 samples: some draw of 4 has it
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (8, 8, 3, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_matches_the_product_form_of_the_codex_paper():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                product = 1.0 if n - c < k else 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
                assert pass_at_k(n, c, k) == pytest.approx(product, abs=1e-12)


def test_pass_at_k_is_the_probability_that_a_random_k_subset_has_a_pass():
    from itertools import combinations

    passes = [True, False, True, False, False]
    subsets = list(combinations(passes, 3))
    assert pass_at_k(5, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_over_prompts_with_a_threshold():
    scores = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0]}
    assert mean_pass_at_k(scores, 1, 1.0) == pytest.approx((0.25 + 0.5) / 2)
    assert mean_pass_at_k(scores, 2, 1.0) == pytest.approx((1 - 3 / 6 + 1 - 1 / 6) / 2)
    partial = {0: [0.6, 0.4], 1: [0.2, 0.3]}  # passes at >= 0.5: one of two, then none
    assert mean_pass_at_k(partial, 1, 0.5) == pytest.approx(0.25)
    assert mean_pass_at_k(partial, 2, 0.5) == pytest.approx(0.5)


def _cfg(*overrides):
    return load_config(GRPO, list(overrides)).config


def _split(cfg):
    tokenizer = load_tokenizer(None, vocab_size=256)
    train = load_prompt_dataset(cfg.data, tokenizer)
    return [i.prompt_ids for i in train], synthetic_split(cfg, tokenizer, [i.prompt_ids for i in train])


def test_synthetic_split_is_disjoint_from_training_and_reproducible():
    cfg = _cfg("data.synthetic.task=parity_match", "trainer.val_every=5")
    train, val = _split(cfg)
    assert len(val) == 64 and len({tuple(i.prompt_ids) for i in val}) == 64
    assert not {tuple(i.prompt_ids) for i in val} & {tuple(p) for p in train}
    assert [i.prompt_ids for i in _split(cfg)[1]] == [i.prompt_ids for i in val]
    assert [i.index for i in val] == list(range(64)) and val[0].answer == val[0].prompt_ids[0]
    small = _split(
        _cfg("data.synthetic.task=parity_match", "trainer.val_every=5", "trainer.val_num_prompts=5")
    )
    assert len(small[1]) == 5


def test_synthetic_split_of_a_repeat_task_is_its_distinct_prompts():
    train, val = _split(_cfg("trainer.val_every=5"))  # parity_repeat: 16 prompts, all in training
    assert sorted(tuple(i.prompt_ids) for i in val) == sorted({tuple(p) for p in train})
    assert len(val) == 16


def test_validation_samples_default_to_a_multiple_of_rollout_n():
    assert validation_samples(_cfg("trainer.val_every=1", "trainer.val_pass_k=[1,4]")) == 4
    assert validation_samples(_cfg("trainer.val_every=1", "trainer.val_pass_k=[6]")) == 8
    assert validation_samples(_cfg("trainer.val_every=1", "trainer.val_n=12")) == 12
    assert not _cfg().trainer.validates and _cfg().trainer.val_every == 0


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (["trainer.val_n=6"], "trainer.val_n", "multiple of rollout.n = 4"),
        (["trainer.val_n=4", "trainer.val_pass_k=[1,8]"], "trainer.val_pass_k", "val_n >= it"),
        (["trainer.val_pass_k=[]"], "trainer.val_pass_k", "at least one k"),
        (["trainer.val_pass_k=[0]"], "trainer.val_pass_k[0]", ">= 1"),
        (["trainer.val_every=-1"], "trainer.val_every", ">= 0"),
        (["trainer.val_num_prompts=0"], "trainer.val_num_prompts", ">= 1"),
        (["data.val_files=[/nonexistent/val.parquet]"], "data.val_files[0]", "no such file"),
    ],
)
def test_bad_validation_settings_fail_at_load_naming_the_key(overrides, key, text):
    with pytest.raises(ConfigError, match=text) as err:
        _cfg("trainer.val_every=2", *overrides)
    assert err.value.key == key


def test_parquet_training_data_needs_val_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a b"], "answer": ["1"]}), path)
    with pytest.raises(ConfigError, match="needs data.val_files") as err:
        _cfg(f"data.train_files=[{path}]", "trainer.val_every=2")
    assert err.value.key == "trainer.val_every"
    cfg = _cfg(f"data.train_files=[{path}]", f"data.val_files=[{path}]", "trainer.val_every=2")
    assert cfg.data.val_files == [str(path)]


def test_val_files_are_read_like_train_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl3d.controller.validation import validation_prompts

    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.table({"prompt": ["1 2", "3 4"], "answer": ["1", "3"]}), train)
    pq.write_table(pa.table({"prompt": ["5 6", "7 8", "9 1"], "answer": ["5", "7", "9"]}), val)
    cfg = _cfg(f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.val_every=2")
    tokenizer = load_tokenizer(None, vocab_size=256)
    items = validation_prompts(cfg, tokenizer, [])
    assert [i.prompt_text for i in items] == ["5 6", "7 8", "9 1"]
    assert [i.index for i in items] == [0, 1, 2] and items[0].source == f"{val}:0"
    limited = _cfg(
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "trainer.val_every=2",
        "trainer.val_num_prompts=2",
    )
    assert len(validation_prompts(limited, tokenizer, [])) == 2


def test_a_resumed_run_drops_the_validation_rows_after_its_step(tmp_path):
    from rl3d.controller.validation import VAL_CSV, read_validation_csv
    from rl3d.logging import drop_rows_after

    rows = "step,val/score_greedy\n0,0.5\n2,0.6\n4,0.7\n"
    (tmp_path / VAL_CSV).write_text(rows)
    assert drop_rows_after(tmp_path, 3) == 1  # the killed run validated step 4 after the checkpoint
    assert read_validation_csv(tmp_path) == [
        {"step": 0.0, "val/score_greedy": 0.5},
        {"step": 2.0, "val/score_greedy": 0.6},
    ]
    assert read_validation_csv(tmp_path / "elsewhere") == []
