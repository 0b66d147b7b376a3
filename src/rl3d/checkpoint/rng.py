"""Capture and restore every random stream a resumed run must continue from.

`capture_rng_state()` covers Python's `random`, numpy's global generator, torch's CPU generator
and, when CUDA is available, every CUDA device's generator. The state holds only tensors and
plain Python values, so it saves with `torch.save` and loads with ``weights_only=True``
(`save_rng_state` / `load_rng_state`). RNG state is per rank: save one file per rank.

A private `torch.Generator` (a sampler's, a rollout engine's) is saved with
`generator_state(gen)` and put back with `restore_generator(gen, state)`.

Megatron's model-parallel CUDA RNG tracker is saved by `rl3d.models.dist_checkpoint` with the
model; this module is the controller-level rest.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a `capture_rng_state()` result (CUDA state only where CUDA is available)."""
    random.setstate(_as_python_state(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ValueError(
                f"restore_rng_state: saved {len(state['cuda'])} CUDA generator states, "
                f"this process sees {torch.cuda.device_count()} devices"
            )
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # random.setstate wants (int, tuple[int, ...], float | None) exactly; lists after a round trip.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def save_rng_state(path: str | os.PathLike) -> None:
    torch.save(capture_rng_state(), path)


def read_rng_state(path: str | os.PathLike) -> dict[str, Any]:
    """A saved RNG state, loaded with ``weights_only=True`` (tensors and plain values only);
    a damaged or foreign file is a ValueError naming it."""
    try:
        return torch.load(path, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: cannot load RNG state ({first})") from err


def load_rng_state(path: str | os.PathLike) -> None:
    restore_rng_state(read_rng_state(path))


def generator_state(gen: torch.Generator) -> dict[str, Any]:
    return {"device": str(gen.device), "state": gen.get_state()}


def restore_generator(gen: torch.Generator, state: dict[str, Any]) -> None:
    if str(gen.device) != state["device"]:
        raise ValueError(
            f"restore_generator: the state is for device {state['device']}, the generator is on {gen.device}"
        )
    gen.set_state(state["state"])
