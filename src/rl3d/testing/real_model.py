"""The real model for tests: its fetched HF directory, or a pytest skip that says why not."""

from __future__ import annotations

from pathlib import Path

SMOLLM2 = "smollm2-135m"


def real_model_dir(name: str = SMOLLM2) -> Path:
    """`rl3d.models.hub.ensure_model(name)`; where it cannot be fetched here, skip the test."""
    import pytest

    from rl3d.models.hub import FetchError, ensure_model

    try:
        return ensure_model(name)
    except FetchError as err:
        pytest.skip(f"real model {name} unavailable (`rl3d models fetch {name}` failed): {err}")
