"""A stand-in Ray driver for the SLURM job test: the batch script runs it where `rl3d.train` runs.

    python ray_probe.py RESOLVED_RECIPE

It joins the job's Ray cluster through $RAY_ADDRESS (as `ray.init()` does for the trainer), runs
one task per node's worth of CPUs and writes `ray_result.json` into the run directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray

import yaml


@ray.remote(num_cpus=1)
def _where() -> str:
    return ray.get_runtime_context().get_node_id()


def main() -> int:
    recipe = yaml.safe_load(Path(sys.argv[1]).read_text())
    run_dir = Path(recipe["trainer"]["run_dir"])
    ray.init(logging_level="ERROR")
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    task_nodes = ray.get([_where.remote() for _ in range(2)])
    result = {
        "ray_address": os.environ.get("RAY_ADDRESS"),
        "alive_nodes": len(nodes),
        "task_nodes": sorted(set(task_nodes)),
        "resolved_recipe": sys.argv[1],
    }
    (run_dir / "ray_result.json").write_text(json.dumps(result))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
