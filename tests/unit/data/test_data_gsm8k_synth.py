"""rl3d.data.gsm8k_synth: seeded GSM8K-style problems in verl's layout, loaded as rl3d loads them."""

import random
import re

import pyarrow.parquet as pq
import pytest

from rl3d.config.schema import DataConfig, RewardConfig
from rl3d.data import load_prompt_dataset, load_tokenizer
from rl3d.data.gsm8k_synth import INSTRUCTION, SOURCE, main, make_problem, make_rows, write_splits
from rl3d.rewards import RewardInput, answer_check_for, resolve_reward_fn


def _worked_answer(solution: str) -> int:
    """Check every ``<<a op b=c>>`` of a worked solution; the number after ``####``."""
    for a, op, b, c in re.findall(r"<<(\d+)([-+*])(\d+)=(\d+)>>", solution):
        assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
    return int(solution.split("####")[-1])


@pytest.mark.parametrize(
    "steps, max_number, ops", [(1, 5, ("add",)), (2, 10, ("add", "sub")), (3, 20, ("mul", "sub"))]
)
def test_problems_are_right_and_respect_the_difficulty(steps, max_number, ops):
    rng = random.Random(0)
    for _ in range(200):
        p = make_problem(rng, steps=steps, max_number=max_number, ops=ops)
        assert _worked_answer(p.solution) == p.answer >= 1
        assert p.solution.count("<<") == steps + ("mul" in ops)  # one line per operation
        numbers = [int(n) for n in re.findall(r"\d+", p.question)]
        assert max(numbers) <= max_number and len(numbers) == steps + 1 + ("mul" in ops)


def test_rows_are_verl_layout_seeded_and_distinct():
    rows = make_rows(50, seed=3, split="train", steps=1, max_number=10)
    assert rows == make_rows(50, seed=3, split="train", steps=1, max_number=10)
    assert rows != make_rows(50, seed=4, split="train", steps=1, max_number=10)
    first = rows[0]
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["data_source"] == SOURCE and first["ability"] == "math"
    (message,) = first["prompt"]
    assert (
        message["role"] == "user"
        and message["content"] == first["extra_info"]["question"] + " " + INSTRUCTION
    )
    assert first["reward_model"] == {
        "style": "rule",
        "ground_truth": str(_worked_answer(first["extra_info"]["answer"])),
    }
    assert [r["extra_info"]["index"] for r in rows] == list(range(50))
    assert len({r["extra_info"]["question"] for r in rows}) == 50
    with_system = make_rows(
        2, seed=3, split="train", steps=1, max_number=10, system="Be brief.", instruction=""
    )
    assert [m["role"] for m in with_system[0]["prompt"]] == ["system", "user"]
    assert with_system[0]["prompt"][1]["content"] == first["extra_info"]["question"]


def test_bad_difficulty_is_refused():
    with pytest.raises(ValueError, match="--ops 'div'"):
        make_rows(1, seed=0, split="train", steps=1, max_number=5, ops=("div",))
    with pytest.raises(ValueError, match="--max-number must be >= 2"):
        make_rows(1, seed=0, split="train", steps=1, max_number=1)
    with pytest.raises(ValueError, match="only .* distinct train problems"):
        make_rows(300, seed=0, split="train", steps=0, max_number=3, ops=("add",))  # 240 exist


def test_cli_writes_train_and_val_without_overlap(tmp_path):
    assert main(["--out", str(tmp_path), "--num-train", "40", "--num-val", "8", "--instruction", "verl"]) == 0
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "val.parquet").to_pylist()
    assert (len(train), len(val)) == (40, 8) and {r["extra_info"]["split"] for r in val} == {"val"}
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in val}
    assert main(["--out", str(tmp_path), "--ops", "pow"]) == 1


def test_the_real_tokenizer_loads_them_and_the_reward_routes_by_source(tmp_path, smollm2_dir):
    train, _ = write_splits(tmp_path, num_train=8, num_val=2, seed=0, steps=1, max_number=5)
    data = DataConfig(train_files=[str(train)], max_prompt_length=128, system_prompt="Answer after ####.")
    reward = RewardConfig(fn_by_source={})  # rl3d/gsm8k_synth is a built-in source: the gsm8k scorer
    tokenizer = load_tokenizer(str(smollm2_dir), vocab_size=49152)
    items = load_prompt_dataset(data, tokenizer, answer_check=answer_check_for(reward, data))
    assert len(items) == 8 and items[0].data_source == SOURCE
    assert items[0].prompt_text.startswith(
        "<|im_start|>system\nAnswer after ####.<|im_end|>\n<|im_start|>user\n"
    )
    assert items[0].prompt_text.endswith("<|im_start|>assistant\n")
    fn = resolve_reward_fn(reward, data)
    scored = RewardInput(
        prompt_index=0,
        prompt_ids=items[0].prompt_ids,
        response_ids=[1],
        prompt_text=items[0].prompt_text,
        response_text=f"#### {items[0].answer}",
        answer=items[0].answer,
        finish_reason="stop",
        data_source=items[0].data_source,
    )
    assert fn(scored) == 1.0
