"""Helpers for the e2e tests: run `rl3d train` for real (torchrun, gloo ranks), read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
PPO = ROOT / "recipes/quickstart_cpu_ppo.yaml"


def train_command(recipe: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rl3d.cli", "train", str(recipe), f"trainer.run_dir={run_dir}", *overrides]


def train_env() -> dict[str, str]:
    env = dict(os.environ, RL3D_YAML_DIR=str(ROOT / "yaml"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    return env


def run_train(
    recipe: Path, run_dir: Path, *overrides: str, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(recipe, run_dir, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=train_env(),
        cwd=cwd,
    )


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The last record of every step (a resumed run appends to the same file)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


TIMING = ("time/", "perf/")  # wall-clock metrics differ run to run
TIMING_KEYS = {"reshard/seconds", "time"}


def assert_same_metrics(a: dict, b: dict, *, exact: bool = False) -> None:
    """Two runs' metrics by step agree on every key but the wall-clock ones: within fp32
    tolerance, or bit for bit with `exact`."""
    assert sorted(a) == sorted(b)
    for step in a:
        keys = {k for k in a[step] if not k.startswith(TIMING) and k not in TIMING_KEYS}
        assert keys == {k for k in b[step] if not k.startswith(TIMING) and k not in TIMING_KEYS}
        for key in sorted(keys):
            x, y = a[step][key], b[step][key]
            if isinstance(x, str) or exact:
                assert x == y, (step, key, x, y)
            else:  # fp32 tolerance; in practice the values are identical
                assert y == pytest.approx(x, rel=1e-5, abs=1e-7), (step, key, x, y)
