"""The tool_multiply task: its tokenizer, its reward from the trajectory or the text, its hook."""

import pytest

from rl3d.data.tool_task import (
    CALL_END_TEXT,
    CALL_TEXT,
    OBS_END_TEXT,
    OBS_TEXT,
    TOOL_MULTIPLY,
    ToolTokenizer,
    turns_from_text,
)
from rl3d.rewards import RewardInput
from rl3d.rewards.tool_task import tool_multiply_metrics, tool_multiply_reward
from rl3d.single_controller.batch import DataBatch

TOK = ToolTokenizer(32)
PROMPT = TOK.encode("4213*7789=")
PRODUCT = str(4213 * 7789)


def call(expression: str) -> str:
    return CALL_TEXT + expression + CALL_END_TEXT


def observe(text: str) -> str:
    return OBS_TEXT + text + OBS_END_TEXT


def test_tokenizer_round_trips_and_keeps_tags_whole():
    text = call("4213*7789") + observe(PRODUCT) + PRODUCT
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text and len(ids) == 2 + 9 + 2 + 8 + 8
    assert TOK.decode(TOK.encode("[error] bad")) == "[?????] ???"  # letters are not in the vocabulary
    assert TOOL_MULTIPLY.operands(PROMPT) == (4213, 7789) and TOOL_MULTIPLY.answer(PROMPT) == 4213 * 7789
    prompts = TOOL_MULTIPLY.make_prompts(50, seed=3)
    assert prompts == TOOL_MULTIPLY.make_prompts(50, seed=3)
    assert all(len(p) == 10 and 1000 <= TOOL_MULTIPLY.operands(p)[0] <= 9999 for p in prompts)


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (call("4213*7789") + observe(PRODUCT) + PRODUCT, 1.0),  # call, copy: everything
        (PRODUCT, 0.5),  # the exact product without the tool (a tiny model cannot)
        (call("4213*7789") + observe(PRODUCT), 0.5),  # no answer after the result
        (call("") + observe("[error]") + "", 0.1),  # an empty call: only "a call"
        (call("4213*7780") + observe("x") + "3", 0.1 + 0.1 + 0.3 * 8 / 9 + 0.5 * 1 / 8),
        ("", 0.0),
    ],
)
def test_reward_from_text_and_from_trajectory_agree(response, score):
    turns = turns_from_text(response)
    trajectory = {"turns": [{"text": t, "observation": o} for t, o in turns]}
    common = dict(prompt_index=0, prompt_ids=PROMPT, response_ids=TOK.encode(response), prompt_text="")
    with_traj = RewardInput(
        **common, response_text=response, answer=None, finish_reason="stop", trajectory=trajectory
    )
    text_only = RewardInput(**common, response_text=response, answer=None, finish_reason="stop")
    assert tool_multiply_reward(with_traj) == pytest.approx(score)
    assert tool_multiply_reward(text_only) == pytest.approx(score)
    assert TOOL_MULTIPLY.score(PROMPT, TOK.encode(response), "length") == pytest.approx(score)


def test_hook_counts_valid_calls_exact_operands_and_answers():
    responses = [
        call("4213*7789") + observe(PRODUCT) + PRODUCT,
        call("4213*7788") + observe("1") + "1",
        call("4213*") + observe("[error]") + PRODUCT[:3],
        "123",
    ]
    records = [{"turns": [{"text": t, "observation": o} for t, o in turns_from_text(r)]} for r in responses]
    batch = DataBatch({}, {"prompt_ids": [PROMPT] * 4, "trajectory": records})
    assert tool_multiply_metrics(step=1, batch=batch, metrics={}) == {
        "tool_task/call_valid": 0.5,
        "tool_task/operands_exact": 0.25,
        "tool_task/answer_exact": 0.25,
    }
