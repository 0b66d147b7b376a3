"""Helpers that run inside a SLURM job written by `rl3d slurm` (see `slurm_script`).

    python -m rl3d.launch.slurm_job preflight RESOLVED --nproc-per-node N --device cpu|cuda
    python -m rl3d.launch.slurm_job wait-ray --nodes N --timeout S

`preflight` runs on every node before any rank starts, so that a path that exists on the login
node but not on the compute nodes, a missing GPU or a broken environment fails the job with one
clear line in the node's log instead of a stack trace per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rl3d.config import ConfigError, RL3DConfig, load_config, run_dir_of


def missing_inputs(cfg: RL3DConfig) -> list[str]:
    """Input paths the recipe names that do not exist on this machine, as 'key: path' lines."""
    named = [(f"data.train_files[{i}]", path) for i, path in enumerate(cfg.data.train_files)]
    named += [("model.hf_path", cfg.model.hf_path), ("data.tokenizer", cfg.data.tokenizer)]
    return [f"{key}: {path}" for key, path in named if path and not Path(path).exists()]


def _visible_gpus() -> int | None:
    """GPUs this process may use, from what SLURM granted; None when it cannot tell."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = os.environ.get(var)
        if value is not None:
            return len([v for v in value.split(",") if v.strip()])
    return None


def preflight(resolved: str, nproc_per_node: int, device: str) -> list[str]:
    """Problems that would stop this node's ranks; empty when it is ready."""
    try:
        cfg = load_config(resolved).config
    except ConfigError as err:
        return [f"config: {err}"]
    problems = [f"{line} (not found on this node)" for line in missing_inputs(cfg)]
    run_dir = run_dir_of(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test_{os.uname().nodename}_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        problems.append(f"trainer.run_dir: {run_dir} is not writable here ({err.strerror})")
    if device == "cuda":
        gpus = _visible_gpus()
        if gpus is not None and gpus < nproc_per_node:
            problems.append(f"{gpus} GPU(s) visible on this node, {nproc_per_node} ranks per node requested")
    return problems


def _running(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_ray(nodes: int, timeout_s: float, watch_pid: int | None = None) -> str | None:
    """Block until `nodes` Ray nodes are alive in $RAY_ADDRESS's cluster; the error, or None.

    `watch_pid` is the head's `srun`: when it has exited, waiting longer is pointless."""
    import ray

    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        if not _running(watch_pid):
            return f"the Ray head (srun pid {watch_pid}) exited; see its node log"
        try:
            if not ray.is_initialized():
                ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR")
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= nodes:
                ray.shutdown()
                return None
        except (ConnectionError, RuntimeError):
            pass  # the head is not up yet
        time.sleep(2)
    return f"only {alive} of {nodes} Ray nodes joined within {timeout_s:.0f}s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl3d.launch.slurm_job", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("resolved")
    pre.add_argument("--nproc-per-node", type=int, required=True)
    pre.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ray_wait = sub.add_parser("wait-ray")
    ray_wait.add_argument("--nodes", type=int, required=True)
    ray_wait.add_argument("--timeout", type=float, default=300.0)
    ray_wait.add_argument("--watch-pid", type=int, default=None)
    args = parser.parse_args(argv)
    node = os.uname().nodename
    if args.command == "preflight":
        problems = preflight(args.resolved, args.nproc_per_node, args.device)
        for line in problems:
            sys.stderr.write(f"rl3d preflight on {node}: {line}\n")
        if not problems:
            sys.stderr.write(f"rl3d preflight on {node}: ok\n")
        return 2 if problems else 0
    error = wait_for_ray(args.nodes, args.timeout, args.watch_pid)
    if error:
        sys.stderr.write(f"rl3d: {error}\n")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
