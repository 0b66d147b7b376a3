import logging
import math

import numpy as np
import pytest
import torch

from rl3d.rewards import RewardError, RewardInput, score_batch


def _inputs(values):
    return [
        RewardInput(
            prompt_index=10 + i,
            prompt_ids=[1],
            response_ids=[2],
            prompt_text="p",
            response_text="r",
            answer=v,
            finish_reason="length",
        )
        for i, v in enumerate(values)
    ]


def echo_answer(inp):
    if inp.answer == "boom":
        raise KeyError("no such thing")
    return inp.answer


def test_scores_in_order_and_numeric_types_accepted():
    values = [1, 0.25, True, np.float32(0.5), torch.tensor(0.75), np.array([2.0])]
    scores, report = score_batch(echo_answer, _inputs(values), on_error="stop")
    assert scores == [1.0, 0.25, 1.0, 0.5, 0.75, 2.0]
    assert all(type(s) is float for s in scores)
    assert report.num_samples == 6 and report.num_errors == 0 and report.errors == []


def test_stop_names_the_prompt_the_function_and_the_error():
    with pytest.raises(RewardError) as info:
        score_batch(echo_answer, _inputs([1.0, "boom"]), on_error="stop")
    err = info.value
    assert err.prompt_index == 11
    assert err.fn_name.endswith("test_rewards_score:echo_answer")
    assert "failed on prompt 11" in str(err) and "KeyError: 'no such thing'" in str(err)
    assert isinstance(err.__cause__, KeyError)


def test_skip_scores_zero_logs_and_counts(caplog):
    values = [1.0, "boom", math.nan, "0.5", None, math.inf, 0.5]
    with caplog.at_level(logging.WARNING, logger="rl3d.rewards.base"):
        scores, report = score_batch(echo_answer, _inputs(values), on_error="skip")
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    assert report.num_errors == 5
    assert [i for i, _ in report.errors] == [11, 12, 13, 14, 15]
    messages = dict(report.errors)
    assert messages[11].startswith("KeyError")
    assert "non-finite" in messages[12] and "non-finite" in messages[15]
    assert "returned str '0.5', not a number" in messages[13]
    assert "returned NoneType" in messages[14]
    assert "failed on prompt 11" in caplog.text


def test_non_numeric_return_stops_by_default():
    with pytest.raises(RewardError, match="not a number"):
        score_batch(echo_answer, _inputs(["x"]))
