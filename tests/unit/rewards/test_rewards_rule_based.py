from decimal import Decimal

import pytest

from rl3d.rewards import RewardInput, extract_gsm8k_answer, gsm8k_reward, math_exact_reward, parse_number
from rl3d.rewards.rule_based import gsm8k_answer_check, gsm8k_flexible_reward, gsm8k_format_credit_reward


def _inp(response_text, answer):
    return RewardInput(
        prompt_index=0,
        prompt_ids=[1],
        response_ids=[2],
        prompt_text="q",
        response_text=response_text,
        answer=answer,
        finish_reason="stop",
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,200 pens", "1,200"),
        ("#### $5", "5"),
        ("first #### 5, then #### 6", "6"),  # the last marked number
        ("I think 3, no 4.5 is it", "4.5"),  # no marker: the last number
        ("#### seven, so 8", "8"),  # a marker without a number does not count
        ("-2.5 it is", "-2.5"),
        ("no digits here", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_strict_extraction_needs_the_marker():
    assert extract_gsm8k_answer("first #### 5, then #### 6", strict=True) == "6"
    assert extract_gsm8k_answer("#### $1,234.00", strict=True) == "1,234.00"
    assert extract_gsm8k_answer("The answer is 42", strict=True) is None
    assert extract_gsm8k_answer("#### seven, so 8", strict=True) is None


def test_parse_number():
    assert parse_number("1,200") == parse_number(1200) == parse_number("1200.0") == parse_number(1200.0)
    assert parse_number(" $72. ") == Decimal(72)
    with pytest.raises(ValueError, match="not a number"):
        parse_number("abc")
    with pytest.raises(ValueError, match="not a finite"):
        parse_number("nan")
    with pytest.raises(TypeError):
        parse_number(None)
    with pytest.raises(TypeError):
        parse_number(True)


# (response, answer, strict, flexible, strict with format credit): a chat model's real formats
GSM8K_CASES = [
    ("so the total is 1200.\n#### 1,200", "1200", 1.0, 1.0, 1.0),
    ("3 apples + 4 apples = 7 apples.\n#### 7", "7", 1.0, 1.0, 1.0),
    ("#### $1,234.00", "1234", 1.0, 1.0, 1.0),  # $, thousands comma and .00 stripped
    ("####42", "42", 1.0, 1.0, 1.0),
    ("The answer is 42", "42", 0.0, 1.0, 0.0),  # no "####": strict gives nothing
    ("The answer is 72.0", "72", 0.0, 1.0, 0.0),
    ("#### 72", 72.0, 1.0, 1.0, 1.0),
    ("#### 71", "72", 0.0, 0.0, 0.1),  # well-formed, wrong: the format credit
    ("12 + 7 = 9\n#### 9", "19", 0.0, 0.0, 0.1),
    ("#### 5 ... wait, 7 apples", "5", 1.0, 1.0, 1.0),  # the marker wins over later numbers
    ("#### 4 then #### 5", "5", 1.0, 1.0, 1.0),  # the last marker counts
    ("#### five", "5", 0.0, 0.0, 0.0),  # a marker without a number is not the format
    ("I give up", "5", 0.0, 0.0, 0.0),
    ("#### -2.50", "-2.5", 1.0, 1.0, 1.0),
]


@pytest.mark.parametrize("response, answer, strict, flexible, credit", GSM8K_CASES)
def test_gsm8k_rewards(response, answer, strict, flexible, credit):
    assert gsm8k_reward(_inp(response, answer)) == strict
    assert gsm8k_flexible_reward(_inp(response, answer)) == flexible
    assert gsm8k_format_credit_reward(_inp(response, answer)) == credit


def test_gsm8k_reward_with_an_unusable_answer_raises():
    with pytest.raises(ValueError):
        gsm8k_reward(_inp("#### 3", "three"))


def test_gsm8k_answer_check_normalises():
    assert gsm8k_answer_check("1,200") == "1200"
    assert gsm8k_answer_check(1200.0) == "1200"
    assert gsm8k_answer_check("-2.50") == "-2.5"
    with pytest.raises(ValueError):
        gsm8k_answer_check("n/a")


def test_math_exact_reward():
    assert math_exact_reward(_inp("  x = 2\n y  ", "x = 2 y")) == 1.0
    assert math_exact_reward(_inp("x=2 y", "x = 2 y")) == 0.0
    assert math_exact_reward(_inp("42", 42)) == 1.0
    with pytest.raises(ValueError, match="no answer"):
        math_exact_reward(_inp("42", None))


def test_gsm8k_rates_reads_exact_and_format_from_the_credit_scores():
    import torch

    from rl3d.rewards.rule_based import gsm8k_rates

    scores = [gsm8k_format_credit_reward(_inp(text, "7")) for text in ("#### 7", "#### 6", "seven", "7")]
    assert scores == [1.0, 0.1, 0.0, 0.0]
    rates = gsm8k_rates(step=1, batch={"score": torch.tensor(scores)}, metrics={})
    assert rates == {"gsm8k/exact": 0.25, "gsm8k/format": 0.5}
