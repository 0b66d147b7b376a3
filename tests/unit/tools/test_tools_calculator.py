"""The calculator computes arithmetic exactly and refuses everything else."""

import pytest

from rl3d.tools import build_tool
from rl3d.tools.calculator import CalculatorError, evaluate

CALC = build_tool("calculator")


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
        ("-7 // 2", "-4"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("123456789 * 987654321", "121932631112635269"),
        ("2**100", "1267650600228229401496703205376"),
        ("-(3)", "-3"),
        ("1.5e3 + 1", "1501"),
    ],
)
def test_arithmetic(expression, expected):
    assert CALC.call({"expression": expression}).text == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).bit_length()", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 < 2", "Compare is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exceed"),
        ("10 ** 5000", "exceed"),
        ("2.0 ** 100000", "overflow"),
        ("(-1) ** 0.5", "complex"),
    ],
)
def test_refusals(expression, message):
    result = CALC.call({"expression": expression})
    assert not result.ok and message in result.error


def test_huge_product_refused_before_computing():
    big = "9" * 900
    with pytest.raises(CalculatorError, match="exceed"):
        evaluate(f"{big} * {big}")
    assert evaluate(f"{big} * 1") == int(big)
