"""The reward-function contract and `score_batch`, which runs one over a batch safely.

A reward function is any ``Callable[[RewardInput], float]``: a built-in (`rl3d.rewards.registry`)
or user code named ``"package.module:function"`` in `reward.fn`. It must return a finite real
number (a Python/numpy number, a bool, or a one-element tensor). Anything else, or raising, is
an error of that sample: with ``reward.on_error: stop`` the batch stops with `RewardError`; with
``skip`` the sample scores 0.0, is logged and is counted in the `ScoreReport`.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl3d.utils.imports import describe_callable

logger = logging.getLogger(__name__)

_MAX_LOGGED_ERRORS = 10


@dataclass(frozen=True, kw_only=True)
class RewardInput:
    """One response to score. `response_ids` excludes padding; when `finish_reason` is "stop"
    its last id is the stop token. `response_text` is the decoded response."""

    prompt_index: int  # PromptItem.index of the prompt
    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str
    response_text: str
    answer: Any
    finish_reason: str  # "stop" | "length"
    # multi-turn rollouts (rollout.agent): turns, tool calls, observations and counts
    # (`rl3d.agents.tool_loop.Trajectory.record`); None for single-turn responses
    trajectory: dict[str, Any] | None = None
    data_source: str | None = None  # the row's data.source_key column (reward.fn_by_source routes by it)


RewardFn = Callable[[RewardInput], float]


class RewardError(RuntimeError):
    """A reward function failed on a sample (``reward.on_error: stop``)."""

    def __init__(self, message: str, *, prompt_index: int, fn_name: str):
        super().__init__(message)
        self.prompt_index = prompt_index
        self.fn_name = fn_name


@dataclass
class ScoreReport:
    num_samples: int = 0
    num_errors: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)  # (prompt_index, message)


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """The registered name of a built-in (its `reward_name`), else ``module:qualname``."""
    return getattr(fn, "reward_name", None) or describe_callable(fn)


def _as_score(value: Any) -> float:
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):  # a torch / numpy array
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if size == 1:
            value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score


def score_batch(
    fn: RewardFn, inputs: list[RewardInput], *, on_error: str = "stop"
) -> tuple[list[float], ScoreReport]:
    """Scores of `inputs` in order, plus a report of the samples that failed (``skip`` mode)."""
    assert on_error in ("stop", "skip"), on_error
    name = reward_fn_name(fn)
    scores: list[float] = []
    report = ScoreReport(num_samples=len(inputs))
    for inp in inputs:
        try:
            scores.append(_as_score(fn(inp)))
            continue
        except Exception as err:
            message = f"{type(err).__name__}: {err}"
            if on_error == "stop":
                raise RewardError(
                    f"reward function {name} failed on prompt {inp.prompt_index}: {message} "
                    "(set reward.on_error: skip to score such samples 0 and go on)",
                    prompt_index=inp.prompt_index,
                    fn_name=name,
                ) from err
        report.num_errors += 1
        report.errors.append((inp.prompt_index, message))
        scores.append(0.0)
        if report.num_errors <= _MAX_LOGGED_ERRORS:
            logger.warning("reward %s failed on prompt %d, scored 0: %s", name, inp.prompt_index, message)
    if report.num_errors > _MAX_LOGGED_ERRORS:
        logger.warning("reward %s: %d more failures not shown", name, report.num_errors - _MAX_LOGGED_ERRORS)
    return scores, report
