import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from rl3d.config.schema import DataConfig, RewardConfig
from rl3d.data import load_prompt_dataset
from rl3d.data.gsm8k import DEFAULT_TEMPLATE, convert, final_answer, main
from rl3d.rewards import answer_check_for

ROWS = [
    {
        "question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
        "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    },
    {
        "question": "A shop sells 400 pens a day. How many pens in 3 days?",
        "answer": "400 * 3 = <<400*3=1200>>1200\n#### 1,200",
    },
    {"question": "Tom owes $5 and pays $7.50. What is his balance?", "answer": "5 - 7.5 = -2.5\n#### -2.5"},
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_final_answer():
    assert final_answer("work\n#### 1,200") == "1200"
    assert final_answer("#### -2.5") == "-2.5"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        final_answer("the answer is 3")
    with pytest.raises(ValueError, match="not a number"):
        final_answer("#### seven")


def test_convert_writes_prompt_answer_solution_and_skips_bad_lines(tmp_path, caplog):
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(1, json.dumps({"question": "no final answer", "answer": "it is 3"}))
    lines.insert(3, "{not json")
    src = _write_jsonl(tmp_path / "train.jsonl", lines)
    dst = tmp_path / "out" / "train.parquet"
    assert main(["--src", str(src), "--dst", str(dst)]) == 0
    table = pq.read_table(dst).to_pydict()
    assert list(table) == ["prompt", "answer", "solution"]
    assert table["answer"] == ["7", "1200", "-2.5"]
    assert table["solution"] == [r["answer"] for r in ROWS]
    assert table["prompt"][0] == DEFAULT_TEMPLATE.format(question=ROWS[0]["question"])
    assert table["prompt"][0].startswith(ROWS[0]["question"]) and '"#### <number>"' in table["prompt"][0]
    assert "train.jsonl:2: skipped: no '#### <number>'" in caplog.text
    assert "train.jsonl:4: skipped" in caplog.text


def test_converted_file_loads_as_a_gsm8k_dataset(tmp_path):
    src = _write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in ROWS])
    dst = tmp_path / "t.parquet"
    assert convert(src, dst, template="Question: {question}") == (3, 0)

    class CharTokenizer:  # one id per character, enough to measure prompt length
        def encode(self, text):
            return [ord(c) % 256 for c in text]

    cfg = DataConfig(train_files=[str(dst)], max_prompt_length=512)
    ds = load_prompt_dataset(
        cfg, CharTokenizer(), answer_check=answer_check_for(RewardConfig(fn="gsm8k"), cfg)
    )
    assert [item.answer for item in ds] == ["7", "1200", "-2.5"]
    assert ds[1].prompt_text == "Question: " + ROWS[1]["question"]


def test_no_usable_line_fails(tmp_path):
    src = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"question": "q", "answer": "none"})])
    assert main(["--src", str(src), "--dst", str(tmp_path / "x.parquet")]) == 1
    assert not (tmp_path / "x.parquet").exists()
    with pytest.raises(ValueError, match="must contain"):
        convert(src, tmp_path / "y.parquet", template="no field")


def test_runs_as_a_module(tmp_path):
    src = _write_jsonl(tmp_path / "t.jsonl", [json.dumps(ROWS[0])])
    dst = tmp_path / "t.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "rl3d.data.gsm8k", "--src", str(src), "--dst", str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 rows" in proc.stderr
    assert pq.read_table(dst).num_rows == 1
