"""The MATH scorer (verl's, after Hendrycks et al.): the last ``\\boxed{...}`` of the response,
normalised, equals the normalised ground truth.

Normalisation removes what does not change the answer: spaces, ``\\left``/``\\right``,
``\\!``, ``\\$``, ``\\%``, degrees, a trailing ``\\text{ unit}``, a short ``x =`` in front;
``\\dfrac``/``\\tfrac`` become ``\\frac``, ``\\frac12`` becomes ``\\frac{1}{2}``, ``\\sqrt3``
becomes ``\\sqrt{3}``, ``a/b`` of integers and ``0.5`` become fractions, ``.5`` becomes ``0.5``.
A response without a boxed answer scores 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from rl3d.rewards.base import RewardInput

_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_INT_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed ") :].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[open_at + 1 : i]
    return None  # unbalanced braces: the answer was cut off


def _fix_fracs(text: str) -> str:
    """One-character arguments get braces: ``\\frac12``, ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            close = part.find("}")
            numerator, tail = part[: close + 1], part[close + 1 :]
            out += numerator + (tail if tail.startswith("{") or not tail else "{" + tail[0] + "}" + tail[1:])
        elif len(part) >= 2:
            out += "{" + part[0] + "}" + (part[1:] if part[1] == "{" else "{" + part[1] + "}" + part[2:])
        else:
            out += part
    return out


def normalise_math_answer(text: str) -> str:
    s = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # a trailing unit: "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # "x = 5" -> "5"
        s = sides[1]
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    match = _INT_SLASH.match(s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


def math_answer_check(answer: Any) -> str:
    """A dataset's MATH ground truth as a string (a boxed one is unboxed); ValueError if empty."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"expected a string or a number, got {type(answer).__name__}")
    text = str(answer)
    boxed = last_boxed(text)
    text = (boxed if boxed is not None else text).strip()
    if not text:
        raise ValueError("empty answer")
    return text


def math_reward(inp: RewardInput) -> float:
    """1.0 when the last boxed answer of the response equals the ground truth once normalised."""
    predicted = last_boxed(inp.response_text)
    if predicted is None:
        return 0.0
    return 1.0 if normalise_math_answer(predicted) == normalise_math_answer(str(inp.answer)) else 0.0
