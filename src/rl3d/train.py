"""The torchrun entry point: `torchrun --nproc-per-node N -m rl3d.train RECIPE [key=value ...]`.

The recipe is loaded and checked before any process group exists, so a bad recipe fails fast
on every rank with the same message. Then rank 0 writes the resolved config into the run
directory, every rank builds its workers, and the single controller runs the loop.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

from rl3d.config import ConfigError, load_config, run_dir_of, write_resolved_config
from rl3d.utils.failures import report_rank_failure
from rl3d.utils.lifetime import die_with_rank_if_spawned

logger = logging.getLogger("rl3d.train")
die_with_rank_if_spawned(__name__)  # a multiprocessing spawn child of a rank ends with it


def main(argv: list[str] | None = None) -> int:
    from rl3d.utils.lifetime import die_with_launcher

    die_with_launcher()  # a rank ends with its torchrun, however that ends (rl3d.utils.lifetime)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun ... -m rl3d.train RECIPE [key.sub=value ...]", file=sys.stderr)  # noqa: T201
        return 2
    try:
        loaded = load_config(argv[0], argv[1:])
        from rl3d.launch.train import PREFLIGHT_DONE_ENV

        if not os.environ.get(PREFLIGHT_DONE_ENV):  # started by torchrun directly, not `rl3d train`
            from rl3d.launch.preflight import check_run_dir, preflight

            preflight(loaded)
            check_run_dir(loaded, launcher=False)  # read-only: every rank runs it
    except ConfigError as err:
        print(f"rl3d: config error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    cfg = loaded.config
    if cfg.launch.backend == "ray":  # one driver process, not a torchrun rank (Ray-on-SLURM runs this)
        from rl3d.launch.ray_launch import run_driver

        return run_driver(loaded)
    from rl3d.logging.process import setup_process, threads_per_rank
    from rl3d.utils.device import init_process_group, resolve_device

    run_dir = run_dir_of(cfg)
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(cfg.launch.device)  # the configured device decides, not the host
    threads = threads_per_rank(cfg.launch.nproc_per_node) if device == "cpu" else None
    setup_process(cfg.logging, rank=rank, log_dir=run_dir / "logs", num_threads=threads)
    init_process_group(device, timeout_s=cfg.launch.timeout_s)
    if dist.get_world_size() != cfg.launch.world_size:
        logger.error(
            "launched %d ranks, the recipe needs launch.world_size = %d",
            dist.get_world_size(),
            cfg.launch.world_size,
        )
        return 2
    world_rank = dist.get_rank()  # own pools turn this world into one world per pool
    try:
        if world_rank == 0:
            write_resolved_config(loaded, run_dir)
        from rl3d.controller.build import build_run
        from rl3d.controller.summary import write_summary
        from rl3d.launch.spmd_backend import SPMDRun

        trainer = build_run(cfg, Path(run_dir), SPMDRun())
        history = trainer.fit()
        if world_rank == 0:
            write_summary(cfg, history, Path(run_dir))
        return 0
    except Exception as err:
        return report_rank_failure(err, world_rank, Path(run_dir) / "logs")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
