"""Rollout engines: the `RolloutEngine` protocol, rl3d's torch engine and the SGLang adapter.

    engine = build_rollout_engine(cfg.rollout, spec=spec, group=gen_tp, model_path=cfg.model.hf_path)
    batch = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=256, n=4, seed=0))

`build_rollout_engine` (rl3d.rollout.factory) builds the recipe's engine; `make_rollout_engine(name,
**kwargs)` passes keywords straight to the class. Importing this package never imports SGLang;
building the sglang engine does.
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
from rl3d.rollout.factory import ENGINES, build_rollout_engine, engine_class, engine_kwargs, push_bucket_mb
from rl3d.rollout.torch_engine import GenerationStats, TorchRolloutEngine


def make_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine `name` ("torch" or "sglang") with the engine class's keyword arguments."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINES)}")
    return engine_class(name)(**kwargs)


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
    "build_rollout_engine",
    "engine_class",
    "engine_kwargs",
    "make_rollout_engine",
    "push_bucket_mb",
]
