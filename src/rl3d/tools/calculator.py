"""A calculator: integer and float arithmetic over a whitelist of ast nodes (never `eval`).

Allowed: numeric literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Names, calls,
attributes, comparisons and everything else are refused. Results are bounded (`max_digits`) so
``9**9**9`` is refused at once instead of hanging the rollout.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rl3d.tools.base import Tool, ToolResult, register_tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str, *, max_digits: int = 1000) -> int | float:
    """The value of an arithmetic `expression`; CalculatorError for anything else."""
    if len(expression) > 10_000:
        raise CalculatorError("expression longer than 10000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError) as err:
        raise CalculatorError(f"not an arithmetic expression: {err}") from None
    max_bits = int(max_digits * math.log2(10)) + 1
    try:
        return _eval(tree.body, max_bits)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError as err:
        raise CalculatorError(f"overflow: {err}") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def _eval(node: ast.AST, max_bits: int) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _bounded(node.value, max_bits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, max_bits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, max_bits), _eval(node.right, max_bits)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            # Refuse before computing: |a**b| has about b*log2|a| bits.
            if abs(left) > 1 and right * max(abs(left).bit_length() - 1, 1) > max_bits:
                raise CalculatorError(f"result would exceed {max_bits} bits")
        elif isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > max_bits + 1:
                raise CalculatorError(f"result would exceed {max_bits} bits")
        return _bounded(_BINARY[type(node.op)](left, right), max_bits)
    raise CalculatorError(f"{type(node).__name__} is not allowed; only numbers and + - * / // % ** ( )")


def _bounded(value: Any, max_bits: int) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise CalculatorError(f"result exceeds {max_bits} bits")
    return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


@register_tool
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (123456 * 789) % 97"}},
        "required": ["expression"],
    }

    def __init__(self, *, max_digits: int = 1000):
        if max_digits <= 0:
            raise ValueError(f"tools.calculator.max_digits must be > 0, got {max_digits}")
        self.max_digits = max_digits

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            value = evaluate(arguments["expression"], max_digits=self.max_digits)
        except CalculatorError as err:
            return ToolResult("", error=str(err))
        return ToolResult(format_number(value))
