"""Rule-based rewards: GSM8K final numbers (strict and flexible) and exact string match.

GSM8K, as verl scores it: *strict* reads the number after the last ``####`` (the format the
prompt asks for) and gives nothing without one; *flexible* falls back to the last number in the
response. Numbers compare as exact decimals after removing thousands commas and a ``$``, so
``#### $1,234.00`` answers ``1234``. Both score 1.0 or 0.0, except `gsm8k_format_credit`: strict,
plus `FORMAT_CREDIT` (0.1) for a well-formed ``#### <number>`` whose number is wrong.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rl3d.rewards.base import RewardInput

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 12, -3.5, 1,234,567.25
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)

FORMAT_CREDIT = 0.1  # gsm8k_format_credit: a wrong number in the asked-for "#### <number>" form


def extract_gsm8k_answer(text: str, *, strict: bool = False) -> str | None:
    """The number after the last ``####``; else (not `strict`) the last number in `text`; else None."""
    marked = _AFTER_HASHES.findall(text)
    if marked:
        return marked[-1]
    if strict:
        return None
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


def gsm8k_score(text: str, answer: Any, *, strict: bool, format_credit: float = 0.0) -> float:
    """1.0 when the response's answer equals `answer` numerically; `format_credit` when a
    ``#### <number>`` is there but wrong; else 0.0."""
    gold = parse_number(answer)
    predicted = extract_gsm8k_answer(text, strict=strict)
    if predicted is None:
        return 0.0
    if parse_number(predicted) == gold:
        return 1.0
    return format_credit if _AFTER_HASHES.search(text) else 0.0


def gsm8k_reward(inp: RewardInput) -> float:
    """Strict GSM8K (verl's default): the number after the last ``####`` equals the answer."""
    return gsm8k_score(inp.response_text, inp.answer, strict=True)


def gsm8k_flexible_reward(inp: RewardInput) -> float:
    """Flexible GSM8K: the number after the last ``####``, else the last number, equals the answer."""
    return gsm8k_score(inp.response_text, inp.answer, strict=False)


def gsm8k_format_credit_reward(inp: RewardInput) -> float:
    """Strict GSM8K, plus `FORMAT_CREDIT` for a wrong number in the ``#### <number>`` form."""
    return gsm8k_score(inp.response_text, inp.answer, strict=True, format_credit=FORMAT_CREDIT)


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


def gsm8k_rates(step: int, batch, metrics: dict) -> dict[str, float]:
    """A `trainer.hooks.on_rollout_end` hook for the `gsm8k_format_credit` reward, whose scores
    tell the two apart: the step's exact-answer rate (`gsm8k/exact`, score 1.0) and format rate
    (`gsm8k/format`, a ``#### <number>`` right or wrong: score >= `FORMAT_CREDIT`)."""
    scores = [float(s) for s in batch["score"]]
    n = max(len(scores), 1)
    return {
        "gsm8k/exact": sum(s == 1.0 for s in scores) / n,
        "gsm8k/format": sum(s >= FORMAT_CREDIT for s in scores) / n,
    }
