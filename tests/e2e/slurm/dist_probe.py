"""A stand-in trainer for the SLURM job tests, run by torchrun exactly where `rl3d.train` runs.

    torchrun ... dist_probe.py RESOLVED_RECIPE

It follows the trainer's side of the preemption contract (see `rl3d.launch.slurm_script`):
gloo process group from torchrun's environment; one "step" per 0.5 s up to
`trainer.total_steps`; on SIGUSR1 the ranks agree (all-reduce) to stop at a step boundary,
rank 0 saves `probe_ckpt.json` and all exit 0; on start, it resumes from that checkpoint.
Rank 0 writes `probe_progress.json` every step and `probe_result.json` at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import yaml

STOP = torch.zeros(1)


def _on_usr1(signum, frame) -> None:
    STOP.fill_(1)


def main() -> int:
    signal.signal(signal.SIGUSR1, _on_usr1)
    recipe = yaml.safe_load(Path(sys.argv[1]).read_text())
    run_dir = Path(recipe["trainer"]["run_dir"])
    total = int(recipe["trainer"]["total_steps"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = torch.tensor([float(rank)])
    dist.all_reduce(ranks)
    ckpt = run_dir / "probe_ckpt.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    step = start
    while step < total:
        time.sleep(0.5)
        step += 1
        stop = STOP.clone()
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0:
            (run_dir / "probe_progress.json").write_text(json.dumps({"step": step, "start": start}))
        if stop.item() and step < total:
            if rank == 0:
                ckpt.write_text(json.dumps({"step": step}))
            dist.barrier()
            dist.destroy_process_group()
            return 0
    if rank == 0:
        result = {
            "world_size": world,
            "rank_sum": ranks.item(),
            "start_step": start,
            "steps": step,
            "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "master": os.environ.get("MASTER_ADDR"),
            "resolved_recipe": sys.argv[1],
        }
        (run_dir / "probe_result.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
