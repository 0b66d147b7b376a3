"""Helpers for the e2e tests: run `rl3d train` for real (torchrun, gloo ranks), read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    recipe: Path, run_dir: Path, *overrides: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(recipe, run_dir, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=train_env(),
    )


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The last record of every step (a resumed run appends to the same file)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}
