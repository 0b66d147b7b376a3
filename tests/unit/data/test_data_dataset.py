import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl3d.config.schema import DataConfig, RewardConfig, SyntheticDataConfig
from rl3d.data import DataError, SyntheticTokenizer, load_prompt_dataset
from rl3d.rewards import answer_check_for


def _write(path, columns: dict, *, row_group_size=2):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def _cfg(files, **kw):
    return DataConfig(train_files=[str(f) for f in files], **kw)


def test_parquet_rows_become_tokenized_prompts(tmp_path, wordlevel, word_id):
    path = _write(
        tmp_path / "a.parquet",
        {
            "question": ["what is two", "two plus three", "three ?"],
            "topic": ["math", "word", "math"],
            "answer": ["2", "5", "3"],
        },
    )
    cfg = _cfg([path], prompt_key="question", template="Q: {question} ( {topic} )")
    ds = load_prompt_dataset(cfg, wordlevel)
    assert len(ds) == 3 and ds.num_bad_rows == 0
    first = ds[0]
    assert first.prompt_text == "Q: what is two ( math )"
    assert first.prompt_ids == [word_id(w) for w in ["Q:", "what", "is", "two", "(", "math", ")"]]
    assert [item.index for item in ds] == [0, 1, 2]
    assert [item.source for item in ds] == [f"{path}:0", f"{path}:1", f"{path}:2"]
    assert [item.answer for item in ds] == ["2", "5", "3"]


def test_bad_rows_are_skipped_logged_and_counted(tmp_path, wordlevel, caplog):
    a = _write(
        tmp_path / "a.parquet",
        {
            "prompt": ["what is two", None, "   ", "two " * 20, "three ?", "plus", "is"],
            "answer": ["2", "1", "1", "1", "abc", None, "1,200"],
        },
    )
    b = _write(tmp_path / "b.parquet", {"prompt": [None, "two"], "answer": ["1", "2"]})
    cfg = _cfg([a, b], max_prompt_length=16)
    check = answer_check_for(RewardConfig(fn="gsm8k"), cfg)
    with caplog.at_level(logging.WARNING, logger="rl3d.data.dataset"):
        ds = load_prompt_dataset(cfg, wordlevel, answer_check=check)
    assert [item.prompt_text for item in ds] == ["what is two", "is", "two"]
    assert [item.source for item in ds] == [f"{a}:0", f"{a}:6", f"{b}:1"]
    assert [item.answer for item in ds] == ["2", "1200", "2"]  # normalised by the gsm8k check
    assert ds.num_bad_rows == 6
    sources = [source for source, _ in ds.bad_rows]
    assert sources == [f"{a}:1", f"{a}:2", f"{a}:3", f"{a}:4", f"{a}:5", f"{b}:0"]
    reasons = dict(ds.bad_rows)
    assert "missing prompt" in reasons[f"{a}:1"]
    assert "empty prompt" in reasons[f"{a}:2"]
    assert "20 tokens > data.max_prompt_length 16" in reasons[f"{a}:3"]
    assert "unparsable answer 'abc'" in reasons[f"{a}:4"]
    assert "missing answer" in reasons[f"{a}:5"]
    assert f"{a}:3" in caplog.text and f"{b}:0" in caplog.text


def test_answers_are_optional_without_a_check(tmp_path, wordlevel):
    path = _write(tmp_path / "a.parquet", {"prompt": ["what is two", "is"]})
    ds = load_prompt_dataset(_cfg([path]), wordlevel)
    assert [item.answer for item in ds] == [None, None]
    wanted = (
        r"has no column 'answer or reward_model.ground_truth' \(data.answer_key\): the reward needs answers"
    )
    with pytest.raises(DataError, match=f"{path} {wanted}"):
        load_prompt_dataset(_cfg([path]), wordlevel, answer_check=lambda a: a)


def test_on_bad_row_error_names_file_and_row(tmp_path, wordlevel):
    path = _write(tmp_path / "a.parquet", {"prompt": ["what is two", "is", None]})
    with pytest.raises(DataError, match=f"{path}:2: missing prompt"):
        load_prompt_dataset(_cfg([path], on_bad_row="error"), wordlevel)


def test_template_naming_a_missing_column_is_an_error(tmp_path, wordlevel):
    path = _write(tmp_path / "a.parquet", {"prompt": ["what is two"]})
    with pytest.raises(DataError, match=f"{path} has no column 'question' \\(data.template\\)"):
        load_prompt_dataset(_cfg([path], template="{prompt} {question}"), wordlevel)
    with pytest.raises(DataError, match="no column 'query'"):
        load_prompt_dataset(_cfg([path], prompt_key="query"), wordlevel)
    with pytest.raises(DataError, match="fields must name columns"):
        load_prompt_dataset(_cfg([path], template="{} x"), wordlevel)


def test_unreadable_files_are_errors(tmp_path, wordlevel):
    with pytest.raises(DataError, match="missing.parquet: no such file"):
        load_prompt_dataset(_cfg([tmp_path / "missing.parquet"]), wordlevel)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_prompt_dataset(_cfg([junk]), wordlevel)


def test_no_usable_rows_is_an_error(tmp_path, wordlevel):
    path = _write(tmp_path / "a.parquet", {"prompt": [None, " "]})
    with pytest.raises(DataError, match="no usable prompts .*2 bad rows; first: .*:0: missing prompt"):
        load_prompt_dataset(_cfg([path]), wordlevel)


def test_synthetic_dataset():
    cfg = DataConfig(synthetic=SyntheticDataConfig(task="parity_match", num_prompts=10, seed=5))
    tok = SyntheticTokenizer(256)
    ds = load_prompt_dataset(cfg, tok)
    assert len(ds) == 10 and ds.num_bad_rows == 0
    item = ds[3]
    assert item.index == 3 and item.source == "synthetic:parity_match:3"
    assert tok.encode(item.prompt_text) == item.prompt_ids and item.answer == item.prompt_ids[0]
    assert [i.prompt_ids for i in load_prompt_dataset(cfg, tok)] == [i.prompt_ids for i in ds]


def test_synthetic_dataset_checks_lengths_and_vocabulary():
    syn = SyntheticDataConfig(task="copy_first", num_prompts=4)
    with pytest.raises(DataError, match="8-token prompts > data.max_prompt_length 4"):
        load_prompt_dataset(DataConfig(synthetic=syn, max_prompt_length=4), SyntheticTokenizer(256))
    with pytest.raises(DataError, match="needs a vocabulary of >= 24 ids"):
        load_prompt_dataset(DataConfig(synthetic=syn), SyntheticTokenizer(20))
    with pytest.raises(DataError, match="did you mean 'copy_first'"):
        load_prompt_dataset(
            DataConfig(synthetic=SyntheticDataConfig(task="copy_frst")), SyntheticTokenizer(256)
        )
