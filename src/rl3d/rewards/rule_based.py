"""Rule-based rewards: GSM8K final numbers and exact string match. Both score 1.0 or 0.0."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rl3d.rewards.base import RewardInput

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 12, -3.5, 1,234,567.25
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####``, else the last number in `text`, else None."""
    marked = _AFTER_HASHES.findall(text)
    if marked:
        return marked[-1]
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(value: Any) -> Decimal:
    """`value` as an exact Decimal: ``"1,200"``, ``"$5"``, ``"72."``, ``72.0`` and ``72`` all work."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        raise TypeError(f"expected a number or a numeric string, got {type(value).__name__}")
    text = str(value).strip().replace(",", "").lstrip("$").rstrip(".")
    try:
        number = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a number") from None
    if not number.is_finite():
        raise ValueError(f"{value!r} is not a finite number")
    return number


def gsm8k_answer_check(answer: Any) -> str:
    """Normalise a dataset answer (``"1,200"`` -> ``"1200"``); ValueError/TypeError if not numeric."""
    return format(parse_number(answer).normalize(), "f")


def gsm8k_reward(inp: RewardInput) -> float:
    """1.0 when the response's final number equals the answer numerically, else 0.0."""
    gold = parse_number(inp.answer)
    predicted = extract_gsm8k_answer(inp.response_text)
    if predicted is None:
        return 0.0
    return 1.0 if parse_number(predicted) == gold else 0.0


def _normalise_ws(text: str) -> str:
    return " ".join(text.split())


def math_exact_answer_check(answer: Any) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"expected a string or a number, got {type(answer).__name__}")
    text = _normalise_ws(str(answer))
    if not text:
        raise ValueError("empty answer")
    return text


def math_exact_reward(inp: RewardInput) -> float:
    """1.0 when the response equals the answer after collapsing whitespace, else 0.0."""
    if inp.answer is None:
        raise ValueError("the prompt has no answer")
    return 1.0 if _normalise_ws(inp.response_text) == _normalise_ws(str(inp.answer)) else 0.0
