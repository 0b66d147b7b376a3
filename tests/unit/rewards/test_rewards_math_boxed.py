import pytest

from rl3d.rewards import RewardInput
from rl3d.rewards.math_boxed import last_boxed, math_answer_check, math_reward, normalise_math_answer


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
        ("so $x = \\boxed{5}$.", "5"),
        ("first \\boxed{1}, finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one
        ("\\boxed{\\sqrt{2}+{1}}", "\\sqrt{2}+{1}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("it is \\boxed 9$ done", "9"),
        ("\\boxed{\\frac{1}{2", None),  # cut off: no answer
        ("no box, 42", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\dfrac{1}{2}", "\\frac12"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\left( 3, 4 \\right)", "(3,4)"),
        ("x = 5", "5"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("\\$18", "18"),
        ("\\sqrt3", "\\sqrt{3}"),
        (".75", "0.75"),
        ("10 \\text{ cm}", "10"),
    ],
)
def test_normalisation_equates(a, b):
    assert normalise_math_answer(a) == normalise_math_answer(b)


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("The area is $\\boxed{\\dfrac{3}{4}}$.", "\\frac{3}{4}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("The answer is 4.", "4", 0.0),  # no boxed answer
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ],
)
def test_math_reward(response, answer, reward):
    assert math_reward(_inp(response, answer)) == reward


def test_math_answer_check():
    assert math_answer_check("The answer: \\boxed{12}") == "12"  # MATH's solution text
    assert math_answer_check(12) == "12"
    with pytest.raises(ValueError, match="empty"):
        math_answer_check("  ")
    with pytest.raises(TypeError):
        math_answer_check(None)
