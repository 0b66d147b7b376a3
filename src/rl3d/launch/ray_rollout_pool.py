"""The Ray backend's rollout pool (`launch.backend: ray`, `rollout.placement: separate`).

    driver:  a TCPStore (the async link and the weight bridge's rendezvous) and the controller,
             the one `RLTrainer` with a `SeparatePool` placement, as under spmd; the
             trainer-side pools' rank actors as in `RayRun.start`
    "rollout": its own placement group of rank actors and its own torch.distributed world
             (the generation TP groups); each rank actor runs `RolloutPoolRunner` in one long
             call, started at set-up and collected when the trainer stops
    weights: the actor pool's rank actors -> the rollout rank actors over `WeightBridge`,
             planned by the same `rl3d.weight_sync` planner (gloo on CPU, NCCL on GPU)

The driver takes a step's samples from the store, as the spmd trainer does. A rollout rank
actor that dies writes nothing there, so every wait of the driver (samples, a weight send, the
bridge's set-up) also watches the rollout ranks' calls: a dead one ends the run at once with
`WorkerDiedError` naming the rollout pool and the rank; one that raised, with its error.
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Any

from rl3d.config import RL3DConfig
from rl3d.config.async_rollout import ROLLOUT_POOL
from rl3d.config.roles import ACTOR

logger = logging.getLogger("rl3d.launch.ray")

WATCH_S = 0.2  # how often a driver wait looks at the rollout ranks
STOP_GRACE_S = 60.0  # after the trainer's stop, how long the rollout ranks may take to return


def _client_store(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


# -- in the rank actors ---------------------------------------------------------------------------
def join_bridge(state, host: str, port: int, plan, num_rollout: int, device: str, timeout_s: float) -> int:
    """On each actor-pool rank actor: its side of the weight bridge (collective with the
    rollout ranks, which join theirs in `run_rollout_rank`), kept in its `RankWorkers`."""
    import torch.distributed as dist

    from rl3d.weight_sync import DeltaSender, WeightBridge

    store = _client_store(host, port, timeout_s)
    rank = dist.get_rank()
    bridge = WeightBridge(
        store,
        rank=rank,
        num_train=plan.train.world_size,
        num_rollout=num_rollout,
        device=device,
        timeout_s=timeout_s,
    )
    state.weight_sync = (bridge, plan, DeltaSender() if plan.delta else None)
    return rank


def send_actor_weights(state) -> Any:
    """On each actor-pool rank actor: send its planned shards of the current actor (TransitionStats)."""
    import torch.distributed as dist

    from rl3d.weight_sync import send_weights

    bridge, plan, delta = state.weight_sync
    shards = state.workers[ACTOR].role.transition_shards()
    return send_weights(bridge, plan, shards, dist.get_rank(), delta=delta)


def run_rollout_rank(
    _state, cfg: RL3DConfig, run_dir: str, num_threads: int, host: str, port: int, plan, device: str
) -> list:
    """On each rollout rank actor, one call: the process set-up, the rollout worker, its side
    of the bridge, then the rollout loop until the trainer stops (`RolloutPoolRunner`)."""
    import torch.distributed as dist

    from rl3d.config.pools import hosting, role_pools
    from rl3d.controller.assemble import build_data
    from rl3d.controller.rollout_pool import rollout_runner
    from rl3d.logging.process import setup_process

    pools = role_pools(cfg)
    pool, actor = hosting(pools, ROLLOUT_POOL), hosting(pools, ACTOR)
    local = dist.get_rank()
    setup_process(
        cfg.logging, rank=pool.offset + local, log_dir=Path(run_dir) / "logs", num_threads=num_threads
    )
    store = _client_store(host, port, cfg.rollout.async_.timeout_s)
    runner = rollout_runner(
        cfg, build_data(cfg), plan, store, pool=pool, local=local, num_train=actor.size, device=device
    )
    return runner.fit()


# -- in the driver --------------------------------------------------------------------------------
class RolloutPool:
    """The driver's handle on the rollout pool: its rank actors and their running loops."""

    def __init__(self, ranks: Any, refs: list):
        self.ranks, self.refs = ranks, refs  # RankActors, one `run_rollout_rank` ref per rank

    def check(self, what: str = "the rollout loop") -> None:
        """Raise if a rollout rank's loop has ended: died (named), or failed (its error); or if
        a rollout rank has been silent for `launch.timeout_s` (its node lost, `Liveness`)."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        if done:
            self._raise(done, what)
        if self.ranks.liveness is not None:
            self.ranks.liveness.check(self.ranks.ranks, role="rollout pool", what=what)

    def _raise(self, done: list, what: str) -> None:
        import ray
        from ray.exceptions import RayActorError

        from rl3d.single_controller.ray import WorkerCallError, WorkerDiedError, _describe

        for ref in done:  # a dead one first: its peers' errors follow from it
            rank = self.refs.index(ref)
            try:
                ray.get(ref, timeout=0)
            except RayActorError as err:
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                nodes = self.ranks.liveness.nodes if self.ranks.liveness is not None else None
                where = f" on node {nodes[rank]}" if nodes else ""
                raise WorkerDiedError(
                    f"rollout pool rank {rank}{where} died during {what} (its Ray actor "
                    f"{ROLLOUT_POOL}/rank{rank} is gone: {reason})",
                    role=ROLLOUT_POOL,
                    rank=rank,
                ) from err
            except Exception as err:
                raise WorkerCallError(
                    f"rollout pool rank {rank} failed during {what}: {_describe(err)}",
                    role=ROLLOUT_POOL,
                    rank=rank,
                ) from err
        rank = self.refs.index(done[0])
        raise WorkerCallError(
            f"rollout pool rank {rank} left the rollout loop during {what}", role=ROLLOUT_POOL, rank=rank
        )

    def wait(self, refs: list, *, role: str, what: str, timeout_s: float, liveness=None) -> list:
        """`refs`' values in order (rank i's call is refs[i]), watching the rollout ranks
        meanwhile, and with `liveness` (the called pool's) the called ranks' nodes."""
        import ray

        from rl3d.single_controller.ray import gather

        deadline = time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=WATCH_S)
            self.check(what)
            if len(ready) == len(refs):
                break
            if liveness is not None:
                liveness.check([r for r, ref in enumerate(refs) if ref not in ready], role=role, what=what)
            if time.monotonic() > deadline:
                break  # gather names the late ranks
        ranks = list(range(len(refs)))
        try:
            out = gather(refs, ranks, role=role, what=what, timeout_s=0.0, liveness=liveness)
        except Exception:
            time.sleep(WATCH_S)  # a broken transfer: name the rollout rank behind it, if one died
            self.check(what)
            raise
        return [out[r] for r in range(len(refs))]

    def finish(self, timeout_s: float = STOP_GRACE_S) -> None:
        """After the trainer's stop: every rollout rank's loop has returned."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        if len(done) < len(self.refs):
            late = [self.refs.index(r) for r in self.refs if r not in done]
            raise RuntimeError(f"rollout pool rank(s) {late} did not stop within {timeout_s:.0f} s")
        for ref in done:
            ray.get(ref, timeout=0)

    def shutdown(self) -> None:
        self.ranks.shutdown()


class RayPoolHost:
    """The Ray driver's side of a rollout pool a placement starts (`PoolHost`): the pool's
    rank actors (after the trainer-side pools), the store they talk through, the actor's rank
    actors' side of the weight bridge."""

    def __init__(
        self, run: Any, cfg: RL3DConfig, run_dir: Path, *, device: str, threads: int, bundle, strategy
    ):
        self.run, self.cfg, self.run_dir = run, cfg, run_dir
        self.device, self.threads, self.bundle, self.strategy = device, threads, bundle, strategy

    def start_rollout_pool(self, rollout: Any, plan: Any) -> Any:
        import ray
        import torch.distributed as dist

        from rl3d.controller.placement import PoolConnection
        from rl3d.hybrid_engine.pool import check_sent
        from rl3d.single_controller.async_link import AsyncLink
        from rl3d.single_controller.ray import RankActors, ResourcePool
        from rl3d.utils.net import free_port

        run, cfg, device, ro = self.run, self.cfg, self.device, self.cfg.rollout.async_
        host, port = ray.util.get_node_ip_address(), free_port()
        run.store = dist.TCPStore(  # the rank actors talk through it until the run closes
            host,
            port,
            is_master=True,
            timeout=datetime.timedelta(seconds=ro.timeout_s),
            wait_for_workers=False,
        )
        res = ResourcePool(rollout.name, num_bundles=rollout.size, bundle=self.bundle, strategy=self.strategy)
        ranks = RankActors(res, node_timeout_s=cfg.launch.timeout_s)
        run.rollout = RolloutPool(ranks, [])
        ranks.init_distributed("nccl" if device == "cuda" else "gloo", timeout_s=cfg.launch.timeout_s)
        run.rollout.refs = [
            h.run.remote(run_rollout_rank, cfg, str(self.run_dir), self.threads, host, port, plan, device)
            for h in ranks.handles
        ]
        actor_ranks = run.pools[ACTOR]
        joins = [
            h.run.remote(join_bridge, host, port, plan, rollout.size, device, ro.timeout_s)
            for h in actor_ranks.handles
        ]
        live = actor_ranks.liveness
        run.rollout.wait(
            joins, role=ACTOR, what="the weight bridge's set-up", timeout_s=ro.timeout_s, liveness=live
        )
        logger.info("rollout pool: %d rank actor(s); %s", rollout.size, plan.describe())

        def send() -> Any:
            refs = [h.run.remote(send_actor_weights) for h in actor_ranks.handles]
            stats = run.rollout.wait(
                refs, role=ACTOR, what="the weight sync", timeout_s=ro.timeout_s, liveness=live
            )
            return check_sent(plan, list(range(len(stats))), stats)

        link = AsyncLink(run.store, timeout_s=ro.timeout_s, who="the Ray driver", check=run.rollout.check)
        # after the trainer's stop: the rollout ranks' loops collected
        return PoolConnection(link=link, send=send, rank=0, on_stop=run.rollout.finish)
