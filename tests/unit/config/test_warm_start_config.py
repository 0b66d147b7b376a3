"""`actor.warm_start`: off by default, validated before anything starts, errors name the key;
demonstration rows (function, .jsonl, .parquet) become token ids and a loss mask."""

import json

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.controller.warm_start import (
    demonstration,
    demonstration_batch,
    demonstrations,
    load_rows,
    step_rows,
)
from rl3d.data.tool_task import (
    OBS_END_ID,
    OBS_ID,
    TOOL_MULTIPLY,
    ToolTokenizer,
    score_turns,
    tool_multiply_demonstrations,
    turns_from_text,
)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
TOOL_RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_grpo.yaml"
GRPO = ROOT / "recipes" / "quickstart_cpu_grpo.yaml"
TOK = ToolTokenizer(32)


def test_off_by_default_and_on_in_the_tool_recipe():
    assert load_config(GRPO).config.actor.warm_start is None
    ws = load_config(TOOL_RECIPE).config.actor.warm_start
    assert ws.data == "rl3d.data.tool_task:tool_multiply_demonstrations" and ws.is_function


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        ("actor.warm_start.data=rl3d.data.tool_task:nope", "actor.warm_start.data", "nope"),
        ("actor.warm_start.data=no_such_pkg.mod:fn", "actor.warm_start.data", "not found"),
        ("actor.warm_start.data=/no/such/demos.jsonl", "actor.warm_start.data", "no such file"),
        ("actor.warm_start.data=demos.txt", "actor.warm_start.data", "expected"),
        ("actor.warm_start.steps=0", "actor.warm_start.steps", "> 0"),
        ("actor.warm_start.lr=-1", "actor.warm_start.lr", "> 0"),
        ("actor.warm_start.num_examples=0", "actor.warm_start.num_examples", "> 0"),
        ("actor.warm_start.stpes=3", "actor.warm_start.stpes", "did you mean"),
        ("actor.warm_start.batch_size=3", "actor.warm_start.batch_size", "dp=2"),
    ],
)
def test_bad_settings_name_the_key(override, key, message):
    extra = ["actor.parallel={tp: 1, pp: 1, dp: 2}"] if "batch_size" in override else []
    with pytest.raises(ConfigError) as err:
        load_config(TOOL_RECIPE, [*extra, override])
    assert err.value.key == key and message in str(err.value), str(err.value)


def test_options_only_for_a_function(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text('{"prompt": "1*2=", "response": "2"}\n')
    with pytest.raises(ConfigError) as err:
        load_config(TOOL_RECIPE, [f"actor.warm_start.data={path}", "actor.warm_start.options={digits: 2}"])
    assert err.value.key == "actor.warm_start.options"


def test_tool_demonstrations_are_solved_trajectories():
    rows = tool_multiply_demonstrations(8, seed=3)
    assert rows == tool_multiply_demonstrations(8, seed=3) != tool_multiply_demonstrations(8, seed=4)
    for row in rows:
        a, b = TOOL_MULTIPLY.operands(row["prompt_ids"])
        call, observation, answer = row["segments"]
        assert [s["loss"] for s in row["segments"]] == [True, False, True]
        assert observation["ids"][0] == OBS_ID and observation["ids"][-1] == OBS_END_ID
        assert TOK.decode(observation["ids"][1:-1]) == str(a * b)  # the calculator's result
        text = TOK.decode(call["ids"] + observation["ids"] + answer["ids"])
        assert score_turns(a, b, turns_from_text(text)) == 1.0  # full reward: call, operands, answer
        assert answer["ids"][-1] == TOK.eos_token_id


def test_rows_become_ids_and_a_loss_mask(tmp_path):
    [row] = tool_multiply_demonstrations(1)
    demo = demonstration(row, TOK)
    lengths = [len(s["ids"]) for s in row["segments"]]
    assert demo.loss_mask == [1] * lengths[0] + [0] * lengths[1] + [1] * lengths[2]
    assert demo.response_ids == [t for s in row["segments"] for t in s["ids"]]  # EOS already there
    text = demonstration({"prompt": "2*3=", "response": "6"}, TOK)  # plain SFT: EOS appended, trained
    assert (text.prompt_ids, text.response_ids, text.loss_mask) == (
        TOK.encode("2*3="),
        TOK.encode("6") + [1],
        [1, 1],
    )
    no_eos = demonstration({"prompt": "2*3=", "segments": [{"text": "6"}], "eos": False}, TOK)
    assert no_eos.response_ids == TOK.encode("6")
    with pytest.raises(ValueError, match="segments"):
        demonstration({"prompt": "2*3="}, TOK)
    batch = demonstration_batch([demo, text], pad_token_id=0, width=(10, len(demo.response_ids)))
    assert batch["attention_mask"][1].tolist() == [0] * 6 + [1] * 4 + [1, 1] + [0] * (
        len(demo.response_ids) - 2
    )
    assert batch["response_mask"][0].tolist() == demo.loss_mask  # observation: attended, not trained


def test_files_and_functions_give_the_same_rows(tmp_path):
    rows = tool_multiply_demonstrations(5)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for source in (
        "rl3d.data.tool_task:tool_multiply_demonstrations",
        tmp_path / "d.jsonl",
        tmp_path / "d.parquet",
    ):
        cfg = load_config(TOOL_RECIPE, [f"actor.warm_start.data={source}", "actor.warm_start.num_examples=5"])
        assert load_rows(cfg.config.actor.warm_start) == rows, source


def test_steps_cycle_through_seeded_epochs():
    steps = step_rows(5, steps=4, batch_size=4, seed=0)
    assert sorted(steps[0] + steps[1][:1]) == [0, 1, 2, 3, 4]  # a whole epoch before repeating
    assert steps == step_rows(5, steps=4, batch_size=4, seed=0) != step_rows(5, steps=4, batch_size=4, seed=1)


def test_a_bad_row_is_reported_and_counted_not_fatal(caplog):
    good = [{"prompt": "2*3=", "response": "6"}, {"prompt": "4*1=", "response": "4"}]
    rows = [good[0], {"prompt": "2*3="}, {"segments": []}, good[1]]
    with caplog.at_level("WARNING", logger="rl3d.controller.warm_start"):
        demos, bad = demonstrations(rows, TOK)
    assert bad == 2 and [d.response_ids[:1] for d in demos] == [TOK.encode("6"), TOK.encode("4")]
    assert "actor.warm_start.data[1]" in caplog.text and "actor.warm_start.data[2]" in caplog.text
    with pytest.raises(ValueError, match="none of the 2 rows"):
        demonstrations(rows[1:3], TOK)
