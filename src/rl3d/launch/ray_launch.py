"""The Ray driver: `rl3d train RECIPE launch.backend=ray` runs the controller in this process.

    ray.init()  (local, or `launch.ray_address` / $RAY_ADDRESS to join a cluster)
    -> pool "actor": one rank actor per rank (actor + rollout + the colocated reference and
       critic), one torch.distributed world (gloo on CPU, NCCL on GPU)
    -> pools "critic" / "reference" when they are not colocated: the same, in their own layout
    -> pool "rollout" with `rollout.placement: separate`: rank actors generating on their own,
       sent the actor's weights after each update (`rl3d.launch.ray_rollout_pool`)
    -> reward: in the driver, or a pool of `reward.num_workers` CPU actors
    -> the run built by `rl3d.controller.build.build_run` as under spmd; RLTrainer.fit()
    -> summary -> ray.shutdown() if Ray was ours

The rank actors write their logs to `run_dir/logs/rank{N}.log`, the driver to `driver.log`;
Ray's own logs are under the session directory printed at start. A worker that dies stops the
driver with an error naming the role and the rank; the exit status is then 1.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from rl3d.config import LoadedConfig, RL3DConfig
from rl3d.logging.process import setup_process, threads_per_rank
from rl3d.workers.rollout_guard import FAULTS_ENV

logger = logging.getLogger("rl3d.launch.ray")

# Environment the Ray workers need from the driver's (a cluster started elsewhere does not
# inherit it): rl3d's yaml dir, user modules on PYTHONPATH, Ray's debugger switches.
FORWARDED_ENV = (
    "PYTHONPATH",
    "RL3D_YAML_DIR",
    "RAY_DEBUG",
    "RAY_DEBUG_POST_MORTEM",
    "RL3D_RAY_CALL_TIMEOUT_S",
    FAULTS_ENV,  # the rollout ranks' fault injection (tests only)
)


def describe_driver(cfg: RL3DConfig) -> str:
    where = cfg.launch.ray_address or os.environ.get("RAY_ADDRESS") or "a local Ray instance"
    return f"Ray driver in this process on {where}: {cfg.launch.world_size} rank actor(s)" + (
        f" + {cfg.reward.num_workers} reward actor(s)" if cfg.reward.num_workers else ""
    )


def setup_rank_process(cfg: RL3DConfig, run_dir: str, num_threads: int, pool: str = "actor"):
    """Runs inside each rank actor of `pool`: the process set-up, then the rank's workers."""
    from rl3d.config.pools import hosting, role_pools
    from rl3d.controller.rank import build_rank

    offset = hosting(role_pools(cfg), pool).offset
    rank = offset + int(os.environ["RANK"])  # the world rank the spmd backend would give it
    setup_process(cfg.logging, rank=rank, log_dir=Path(run_dir) / "logs", num_threads=num_threads)
    return build_rank(cfg, run_dir, pool)


def make_reward_worker(cfg: RL3DConfig):
    """Runs inside each reward actor (and in the driver when scoring is not fanned out)."""
    from rl3d.controller.rank import run_tokenizer
    from rl3d.models.spec import spec_of
    from rl3d.workers.roles import RewardWorker

    return RewardWorker(cfg, run_tokenizer(cfg, spec_of(cfg.model)))


def _device_kind(cfg: RL3DConfig) -> str:
    import ray

    if cfg.launch.device == "cpu":
        return "cpu"
    has_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    if cfg.launch.device == "cuda" and not has_gpu:
        raise RuntimeError("launch.device = cuda, but the Ray cluster has no GPU")
    return "cuda" if has_gpu else "cpu"


class RayRun:
    """The driver's handles: rank actors of each pool, reward pool; `close()` releases them."""

    def __init__(self) -> None:
        self.pools: dict[str, Any] = {}  # pool name -> RankActors
        self.reward_pool: Any = None
        self.rollout: Any = None  # rl3d.launch.ray_rollout_pool.RolloutPool with placement: separate
        self.store: Any = None  # the TCPStore of the rollout pool's link and weight bridge

    def start(self, cfg: RL3DConfig, run_dir: Path, data, placement):
        """One placement group and torch.distributed world per trainer pool of the placement
        (`rl3d.config.pools`), the actor's first, so a role in its own pool can load the actor's
        initial weights; then what the placement starts (a separate rollout pool:
        `rl3d.launch.ray_rollout_pool.RayPoolHost`). `rl3d.controller.build.RunBackend`."""
        from rl3d.config.pools import role_pools
        from rl3d.controller.build import Started
        from rl3d.launch.ray_rollout_pool import RayPoolHost
        from rl3d.single_controller.ray import RankActors, ResourcePool

        device = _device_kind(cfg)
        threads = threads_per_rank(cfg.launch.nproc_per_node)
        bundle = {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": threads}
        strategy = "STRICT_PACK" if cfg.launch.nnodes == 1 else "PACK"
        pools = placement.trainer_pools(role_pools(cfg))
        for pool in pools:
            res = ResourcePool(pool.name, num_bundles=pool.size, bundle=bundle, strategy=strategy)
            self.pools[pool.name] = ranks = RankActors(res, node_timeout_s=cfg.launch.timeout_s)
            ranks.init_distributed("nccl" if device == "cuda" else "gloo", timeout_s=cfg.launch.timeout_s)
            ranks.setup(setup_rank_process, cfg, str(run_dir), threads, pool.name)
        host = RayPoolHost(
            self, cfg, run_dir, device=device, threads=threads, bundle=bundle, strategy=strategy
        )
        placement.launch(host)
        return Started(roles=RayBackend(cfg, self, pools))

    def close(self) -> None:
        for part in (self.rollout, self.reward_pool, *self.pools.values()):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as err:  # the cluster may already be gone
                    logger.debug("shutting down %s: %s", part, err)


class RayBackend:
    """The driver's side of every role: the role's group on its pool's rank actors."""

    writes = True  # the driver is the only process that logs and writes trainer state

    def __init__(self, cfg: RL3DConfig, run: RayRun, pools: list):
        self.cfg, self.run, self.pools = cfg, run, pools

    def group(self, role: str):
        from rl3d.config.pools import hosting

        return self.run.pools[hosting(self.pools, role).name].group(role)

    def reward_group(self):
        from rl3d.single_controller.ray import FanOutGroup, LocalWorkerGroup, ResourcePool

        cfg = self.cfg
        if not cfg.reward.num_workers:
            return LocalWorkerGroup(make_reward_worker(cfg), role="reward")
        reward_pool = ResourcePool(
            "reward", num_bundles=cfg.reward.num_workers, bundle={"CPU": 1}, strategy="PACK"
        )
        self.run.reward_pool = FanOutGroup(reward_pool, make_reward_worker, cfg, role="reward")
        return self.run.reward_pool

    def rank_files(self):
        from rl3d.controller.assemble import RankFiles
        from rl3d.controller.rank import load_rank_files, save_rank_files

        def on_every_pool(fn, *args, what: str) -> None:
            for ranks in self.run.pools.values():  # each pool's checkpoint is collective in its own world
                ranks.run(fn, *args, what=what)

        return RankFiles(
            save=lambda tmp, step: on_every_pool(save_rank_files, tmp, step, what="checkpoint save"),
            load=lambda path: on_every_pool(load_rank_files, path, what="checkpoint load"),
            world_size=self.cfg.launch.world_size,
        )

    def agree(self, flag: bool) -> bool:
        return flag  # one driver decides


def run_driver(loaded: LoadedConfig) -> int:
    """Start (or join) Ray, build, fit, summarise. 0 on success, 1 on a failed run."""
    import ray

    from rl3d.config import run_dir_of, write_resolved_config
    from rl3d.controller.build import build_run
    from rl3d.controller.summary import write_summary
    from rl3d.single_controller.ray import WorkerCallError, WorkerDiedError

    cfg = loaded.config
    run_dir = Path(run_dir_of(cfg))
    setup_process(cfg.logging, rank=0, log_dir=None, num_threads=threads_per_rank(cfg.launch.nproc_per_node))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    driver_log = logging.FileHandler(run_dir / "logs" / "driver.log")
    driver_log.setFormatter(logging.getLogger("rl3d").handlers[0].formatter)
    logging.getLogger("rl3d").addHandler(driver_log)

    address = cfg.launch.ray_address or os.environ.get("RAY_ADDRESS")
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    started = time.perf_counter()
    common: dict[str, Any] = dict(
        namespace=f"rl3d-{os.getpid()}-{int(time.time())}",
        logging_level=logging.WARNING,
        runtime_env={"env_vars": env} if env else None,
    )
    if address:
        context = ray.init(address=address, **common)
    else:
        world = cfg.launch.world_size * threads_per_rank(cfg.launch.nproc_per_node) + cfg.reward.num_workers
        # "local": always a new instance of our own, never some other job's cluster on this machine
        context = ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, world), include_dashboard=False, **common
        )
    info = context.address_info
    logger.info(
        "Ray %s at %s (%s); Ray's logs: %s/logs",
        ray.__version__,
        info.get("gcs_address", address),
        "joined" if address else "started here",
        info.get("session_dir", "?"),
    )
    run = RayRun()
    try:
        write_resolved_config(loaded, run_dir)
        trainer = build_run(cfg, run_dir, run)
        logger.info("ray backend ready in %.1f s", time.perf_counter() - started)
        history = trainer.fit()
        write_summary(cfg, history, run_dir)
        return 0
    except Exception as err:
        # a dead worker or a failed call already says where (and carries the worker's traceback)
        known = isinstance(err, (WorkerDiedError, WorkerCallError))
        logger.error("run failed: %s: %s", type(err).__name__, err, exc_info=not known)
        return 1
    finally:
        run.close()
        ray.shutdown()
        logging.getLogger("rl3d").removeHandler(driver_log)
        driver_log.close()
