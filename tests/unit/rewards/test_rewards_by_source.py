"""`reward.fn_by_source`: each row scored by the reward of its `data_source`, as verl routes them."""

import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.schema import DataConfig, RewardConfig
from rl3d.data import DataError, SyntheticTokenizer, load_prompt_dataset
from rl3d.rewards import RewardError, RewardInput, answer_check_for, resolve_reward_fn, score_batch

FILES = DataConfig(train_files=["x.parquet"])
GSM8K, MATH = "openai/gsm8k", "HuggingFaceH4/MATH-500"


def _inp(text, answer, source, index=0):
    return RewardInput(
        prompt_index=index,
        prompt_ids=[1],
        response_ids=[2],
        prompt_text="q",
        response_text=text,
        answer=answer,
        finish_reason="stop",
        data_source=source,
    )


def test_builtin_sources_route_to_their_scorers():
    fn = resolve_reward_fn(RewardConfig(fn_by_source={}), FILES)
    assert fn(_inp("2 + 3 = 5\n#### 5", "5", GSM8K)) == 1.0
    assert fn(_inp("The answer is 5", "5", GSM8K)) == 0.0  # gsm8k is strict
    assert fn(_inp("so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", MATH)) == 1.0
    assert fn(_inp("#### 5", "5", MATH)) == 0.0  # MATH reads \boxed, not ####
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"):
        assert fn(_inp("\\boxed{7}", "7", source)) == 1.0


def test_a_source_without_a_reward_is_an_error_naming_it_and_the_row():
    fn = resolve_reward_fn(RewardConfig(fn_by_source={"mine": "gsm8k_flexible"}), FILES)
    assert fn(_inp("it is 5", "5", "mine")) == 1.0
    with pytest.raises(RewardError, match=r"on prompt 3: UnknownSource: data_source 'other' has no reward"):
        score_batch(fn, [_inp("#### 5", "5", GSM8K, 0), _inp("5", "5", "other", 3)])


def test_unlisted_sources_fall_back_to_reward_fn():
    fn = resolve_reward_fn(RewardConfig(fn="math_exact", fn_by_source={}), FILES)
    assert fn(_inp("x = 2", "x = 2", "somewhere/else")) == 1.0
    assert fn(_inp("#### 2", "2", GSM8K)) == 1.0


def test_the_table_overrides_builtin_sources_and_pickles():
    fn = resolve_reward_fn(RewardConfig(fn_by_source={GSM8K: "gsm8k_format_credit"}), FILES)
    assert fn(_inp("#### 4", "5", GSM8K)) == 0.1
    clone = pickle.loads(pickle.dumps(fn))
    assert clone(_inp("#### 4", "5", GSM8K)) == 0.1 and clone(_inp("#### 5", "5", GSM8K)) == 1.0


def test_unknown_reward_names_the_key():
    with pytest.raises(ValueError, match=r"reward\.fn_by_source\.mine: unknown reward 'gsm8K'.*'gsm8k'"):
        resolve_reward_fn(RewardConfig(fn_by_source={"mine": "gsm8K"}), FILES)


def test_answer_checks_follow_the_source():
    check = answer_check_for(RewardConfig(fn_by_source={}), FILES)
    assert check("1,200", GSM8K) == "1200"
    assert check("\\boxed{1,200}", MATH) == "1,200"
    with pytest.raises(ValueError):
        check("twelve", GSM8K)
    with pytest.raises(LookupError, match="data_source 'x' has no reward"):
        check("1", "x")


def _parquet(path, sources, answers):
    prompts = [f"{i} {i + 1}" for i in range(len(sources))]  # SyntheticTokenizer reads ids
    pq.write_table(pa.table({"data_source": sources, "prompt": prompts, "answer": answers}), str(path))
    return str(path)


def test_a_verl_style_parquet_routes_row_by_row(tmp_path):
    path = _parquet(tmp_path / "mix.parquet", [GSM8K, MATH, GSM8K], ["1,200", "\\frac{1}{2}", "n/a"])
    cfg = DataConfig(train_files=[path])
    check = answer_check_for(RewardConfig(fn_by_source={}), cfg)
    ds = load_prompt_dataset(cfg, SyntheticTokenizer(256), answer_check=check)
    assert [(i.data_source, i.answer) for i in ds] == [(GSM8K, "1200"), (MATH, "\\frac{1}{2}")]
    assert ds.bad_rows[0][0] == f"{path}:2" and "unparsable answer 'n/a'" in ds.bad_rows[0][1]


def test_loading_stops_at_a_source_without_a_reward(tmp_path):
    path = _parquet(tmp_path / "mix.parquet", [GSM8K, "my/data"], ["1", "2"])
    cfg = DataConfig(train_files=[path])
    check = answer_check_for(RewardConfig(fn_by_source={}), cfg)
    with pytest.raises(DataError, match=rf"{path}:1: data_source 'my/data' has no reward"):
        load_prompt_dataset(cfg, SyntheticTokenizer(256), answer_check=check)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["1 1"], "answer": ["2"]}), str(plain))
    with pytest.raises(DataError, match="reward.fn_by_source needs each row's source.*'data_source'"):
        load_prompt_dataset(DataConfig(train_files=[str(plain)]), SyntheticTokenizer(256), answer_check=check)


def test_the_config_check_names_the_source(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "defaults: [models/tiny_llama, algos/grpo, rollout/torch_cpu, clusters/local_cpu]\n"
        "data: {train_files: [x.parquet]}\n"
        "reward: {fn_by_source: {openai/gsm8k: gsm8k_strict}}\n"
    )
    with pytest.raises(ConfigError, match=r"fn_by_source\.openai/gsm8k: unknown reward 'gsm8k_strict'"):
        load_config(recipe)
    cfg = load_config(recipe, ["reward.fn_by_source={openai/gsm8k: gsm8k_flexible}"]).config
    assert cfg.reward.fn_by_source == {"openai/gsm8k": "gsm8k_flexible"}
