"""Rollout engines: the `RolloutEngine` protocol, rl3d's torch engine and the SGLang adapter.

    engine = make_rollout_engine("torch", spec=spec, weights=generation_weights, group=groups.gen_tp)
    batch = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=256, n=4, seed=0))

Importing this package never imports SGLang; `make_rollout_engine("sglang", ...)` does.
"""

from __future__ import annotations

from typing import Any

from rl3d.rollout.base import (
    FINISH_LENGTH,
    FINISH_REASONS,
    FINISH_STOP,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
)
from rl3d.rollout.torch_engine import GenerationStats, TorchRolloutEngine

ENGINES = ("torch", "sglang")


def make_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine `name` ("torch" or "sglang") with the engine class's keyword arguments."""
    if name == "torch":
        return TorchRolloutEngine(**kwargs)
    if name == "sglang":
        from rl3d.rollout.sglang_engine import SGLangRolloutEngine

        return SGLangRolloutEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINES)}")


__all__ = [
    "ENGINES",
    "FINISH_LENGTH",
    "FINISH_REASONS",
    "FINISH_STOP",
    "GenerationStats",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "TorchRolloutEngine",
    "make_rollout_engine",
]
