"""Chat-format data: verl-layout parquet written by pyarrow, messages through a real HF chat
template (SmolLM2-Instruct's, on a small offline vocabulary), dotted keys, column types."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl3d.config import FieldError
from rl3d.config.schema import DataConfig, RewardConfig
from rl3d.data import DataError, load_prompt_dataset, load_tokenizer
from rl3d.rewards import answer_check_for
from rl3d.testing.chat import DEFAULT_SYSTEM, save_chat_tokenizer, verl_row, write_verl_parquet

QUESTIONS = [("what is two plus two ?", "4"), ("what is three plus three ?", "6"), ("what is two ?", "2")]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return load_tokenizer(str(save_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))), vocab_size=64)


@pytest.fixture
def verl_file(tmp_path):
    return write_verl_parquet(
        tmp_path / "train.parquet", [verl_row(q, a, i) for i, (q, a) in enumerate(QUESTIONS)]
    )


def _framed(user: str, system: str = DEFAULT_SYSTEM) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_verl_layout_loads_with_train_files_alone(verl_file, chat_tok):
    cfg = DataConfig(train_files=[verl_file])
    ds = load_prompt_dataset(cfg, chat_tok, answer_check=answer_check_for(RewardConfig(fn="gsm8k"), cfg))
    assert len(ds) == 3 and ds.num_bad_rows == 0
    first = ds[0]
    assert first.prompt_text == _framed("what is two plus two ?")  # the generation prompt ends it
    assert first.prompt_ids == chat_tok.encode(first.prompt_text, add_special_tokens=False)
    assert first.prompt_ids[0] == chat_tok.convert_tokens_to_ids("<|im_start|>")
    assert [item.answer for item in ds] == ["4", "6", "2"]  # reward_model.ground_truth, by default
    assert {item.data_source for item in ds} == {"openai/gsm8k"}


def test_system_prompt_is_put_first_unless_the_row_has_one(tmp_path, chat_tok):
    rows = [verl_row("what is two ?", "2", 0), verl_row("what is three ?", "3", 1)]
    rows[1]["prompt"] = [
        {"role": "system", "content": "three"},
        {"role": "user", "content": "what is three ?"},
    ]
    path = write_verl_parquet(tmp_path / "t.parquet", rows)
    ds = load_prompt_dataset(DataConfig(train_files=[path], system_prompt="plus two"), chat_tok)
    assert [item.prompt_text for item in ds] == [
        _framed("what is two ?", "plus two"),
        _framed("what is three ?", "three"),
    ]
    # the messages the template framed, for agents (`rollout.agent` hands them over as the prompt)
    assert [item.messages for item in ds] == [
        [{"role": "system", "content": "plus two"}, {"role": "user", "content": "what is two ?"}],
        rows[1]["prompt"],
    ]


def test_text_prompts_and_chat_template_modes(tmp_path, chat_tok, verl_file):
    path = str(tmp_path / "text.parquet")
    pq.write_table(pa.table({"prompt": ["what is two ?"], "answer": ["2"]}), path)
    auto = load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    assert auto[0].prompt_text == "what is two ?"  # auto: text is used as it is
    always = load_prompt_dataset(
        DataConfig(train_files=[path], chat_template="always", template="{prompt} plus"), chat_tok
    )
    assert always[0].prompt_text == _framed("what is two ? plus")  # the formatted text is the user's turn
    with pytest.raises(
        DataError,
        match=r"train.parquet: column 'prompt' \(data.prompt_key\) holds chat messages, but "
        "data.chat_template is never",
    ):
        load_prompt_dataset(DataConfig(train_files=[verl_file], chat_template="never"), chat_tok)
    with pytest.raises(FieldError, match="system_prompt"):
        DataConfig(train_files=[path], chat_template="never", system_prompt="x")


def test_dotted_keys_read_struct_fields(verl_file, chat_tok):
    cfg = DataConfig(
        train_files=[verl_file],
        prompt_key="extra_info.question",
        template="{extra_info[question]} plus two",
        answer_key="extra_info.answer",
        source_key="ability",
    )
    ds = load_prompt_dataset(cfg, chat_tok)
    assert [item.prompt_text for item in ds][0] == "what is two plus two ? plus two"
    assert [item.answer for item in ds] == ["4", "6", "2"] and ds[0].data_source == "math"
    with pytest.raises(
        DataError, match=r"has no column 'reward_model.answer' \(data.answer_key\): the reward needs"
    ):
        load_prompt_dataset(
            DataConfig(train_files=[verl_file], answer_key="reward_model.answer"), chat_tok, answer_check=str
        )


def test_bad_messages_are_bad_rows(tmp_path, chat_tok, caplog):
    rows = [verl_row(q, a, i) for i, (q, a) in enumerate(QUESTIONS)]
    rows[1]["prompt"] = [{"role": "human", "content": "what is two ?"}]  # ShareGPT's role name
    rows[2]["prompt"] = []
    path = write_verl_parquet(tmp_path / "bad.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="rl3d.data.dataset"):
        ds = load_prompt_dataset(DataConfig(train_files=[path]), chat_tok)
    assert len(ds) == 1 and ds.num_bad_rows == 2
    reasons = dict(ds.bad_rows)
    assert "message 0 has role 'human'; known roles: system, user, assistant, tool" in reasons[f"{path}:1"]
    assert "not a non-empty list" in reasons[f"{path}:2"]
    assert f"skipping bad row {path}:1" in caplog.text
    with pytest.raises(DataError, match=f"{path}:1: column 'prompt': message 0 has role 'human'"):
        load_prompt_dataset(DataConfig(train_files=[path], on_bad_row="error"), chat_tok)


@pytest.mark.parametrize(
    "columns, key, message",
    [
        (
            {"prompt": [["what", "is"]]},
            {},
            r"column 'prompt' \(data.prompt_key\) is list<element: string>, expected a string or a "
            r"list of \{role, content\}",
        ),
        (
            {"prompt": ["two"], "answer": [[1, 2]]},
            {},
            r"column 'answer' \(data.answer_key\) is list<element: int64>, expected a string or a number",
        ),
        (
            {"prompt": ["two"], "data_source": [1]},
            {},
            r"column 'data_source' \(data.source_key\) is int64, expected a string",
        ),
        (
            {"prompt": ["two"]},
            {"prompt_key": "prompt.text"},
            r"has no column 'prompt.text' \(data.prompt_key\)",
        ),
    ],
    ids=["list-for-string", "list-answer", "int-source", "no-such-field"],
)
def test_column_of_the_wrong_type_is_a_recipe_error(tmp_path, chat_tok, columns, key, message):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table(columns), path)
    with pytest.raises(DataError, match=message):
        load_prompt_dataset(DataConfig(train_files=[path], **key), chat_tok)


def test_messages_need_a_tokenizer_with_a_chat_template(verl_file, wordlevel):
    with pytest.raises(DataError, match=r"the prompts need a chat template \(data.chat_template: auto\)"):
        load_prompt_dataset(DataConfig(train_files=[verl_file]), wordlevel)


def test_verl_layout_with_the_real_smollm2_tokenizer(smollm2_dir, verl_file):
    """SmolLM2-135M-Instruct's own tokenizer and chat template (`rl3d models fetch`): the ids
    are those of transformers' tokenizing chat template (no second BOS), the frame is ChatML."""
    tok = load_tokenizer(str(smollm2_dir), vocab_size=49152)
    ds = load_prompt_dataset(DataConfig(train_files=[verl_file]), tok)
    messages = [{"role": "user", "content": QUESTIONS[0][0]}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ds[0].prompt_ids == list(expected)
    assert ds[0].prompt_text == _framed(QUESTIONS[0][0])  # its default system prompt, as above
    assert tok.convert_ids_to_tokens(ds[0].prompt_ids[:1]) == ["<|im_start|>"]


def test_messages_under_another_key_and_a_template_that_would_be_ignored(tmp_path, chat_tok):
    rows = [
        dict(verl_row("what is two ?", "2", 0), conversation=[{"role": "user", "content": "what is two ?"}])
    ]
    path = write_verl_parquet(tmp_path / "t.parquet", rows)
    ds = load_prompt_dataset(DataConfig(train_files=[path], prompt_key="conversation"), chat_tok)
    assert ds[0].prompt_text == _framed("what is two ?")  # the default template is not in the way
    with pytest.raises(
        DataError,
        match=r"data.template '\{ability\}: \{prompt\}' reads \['ability'\], but column 'prompt' holds chat",
    ):
        load_prompt_dataset(DataConfig(train_files=[path], template="{ability}: {prompt}"), chat_tok)
