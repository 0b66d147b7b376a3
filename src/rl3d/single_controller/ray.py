"""The Ray worker-group backend: the driver runs the controller, each rank is a Ray actor.

    pool = ResourcePool("actor", num_bundles=2, bundle={"CPU": 1})
    ranks = RankActors(pool, timeout_s=300)        # placement group + one actor per rank
    ranks.init_distributed("gloo", timeout_s=300)  # the actors' own torch.distributed world
    ranks.setup(build_fn, cfg)                     # build_fn(cfg) runs in every actor
    actor = ranks.group("actor")                   # same `call()` protocol as SPMDWorkerGroup

A resource pool is a placement group with one bundle per rank; the roles that share a pool
share its actors (actor, rollout, reference and critic live in the same rank actor, like the
spmd backend's ranks). Dispatch runs the modes of `rl3d.single_controller.dispatch`: ONE_TO_ALL sends the same
arguments to every rank and returns rank 0's result; the other modes put one share per slot
(DP rank, or generation-DP rank) in the object store and collect as the mode says.

Every wait has a deadline (`CALL_TIMEOUT_S` or the caller's `timeout_s`; placement:
`PLACEMENT_TIMEOUT_S`). A rank actor that dies surfaces as `WorkerDiedError` naming the role
and the rank as soon as Ray notices; a method that raises, as `WorkerCallError` with the
worker's traceback. Reward scoring can fan out to a `FanOutGroup` of CPU actors.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from rl3d.single_controller.batch import DataBatch, to_host
from rl3d.single_controller.dispatch import (
    MODES,
    Dispatch,
    DispatchInfo,
    dispatch_mode,
    merge_outputs,
    metrics_reduction,
)
from rl3d.single_controller.ray_liveness import PING_PERIOD_S, Liveness, WorkerDiedError
from rl3d.utils.net import free_port

logger = logging.getLogger(__name__)

# The longest one worker call (generate, update, checkpoint save) may take before the driver
# gives up on it. Generous: a dead actor is reported at once, this only catches hangs.
# `RL3D_RAY_CALL_TIMEOUT_S` overrides it.
CALL_TIMEOUT_S = float(os.environ.get("RL3D_RAY_CALL_TIMEOUT_S", 3600.0))
# How long a pool's placement group may wait for its bundles (a cluster too small fails here).
PLACEMENT_TIMEOUT_S = 300.0
# After one rank fails, how long to wait for the others: a rank that died is named in
# preference to its peers whose collectives broke because of it.
FAILURE_GRACE_S = 10.0


class WorkerCallError(RuntimeError):
    """A worker method raised; the message holds its cause and the worker's traceback."""

    def __init__(self, message: str, *, role: str, rank: int):
        super().__init__(message)
        self.role, self.rank = role, rank


class RankHost:
    """One rank's Ray actor: hosts the workers a builder made, runs their methods."""

    def __init__(self, rank: int, world_size: int):
        import ray

        self.rank, self.world_size = rank, world_size
        self.state: Any = None
        self.workers: dict[str, Any] = {}
        self.node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"  # named in errors

    def where(self) -> str:
        """This actor's node, hostname (IP); also the liveness ping (its own concurrency group)."""
        return self.node

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the group's rendezvous when asked of rank 0."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, backend: str, master_addr: str, master_port: int, timeout_s: float) -> None:
        from rl3d.utils.device import device_of_backend, init_process_group

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            # Ray shows a GPU actor only its own device: it is device 0 of this process
            LOCAL_RANK="0" if backend == "nccl" else str(self.rank),
        )
        init_process_group(
            device_of_backend(backend), timeout_s=timeout_s, rank=self.rank, world_size=self.world_size
        )

    def setup(self, builder: Callable[..., Any], *args: Any) -> dict[str, tuple[DispatchInfo, dict]]:
        """Run `builder(*args)` here; it returns an object with `.workers` (role -> worker) or
        that dict itself. Returns each role's DispatchInfo and its methods' dispatch modes."""
        self.state = builder(*args)
        self.workers = getattr(self.state, "workers", self.state)
        described = {}
        for role, worker in self.workers.items():
            modes = {
                name: (dispatch_mode(getattr(worker, name)), metrics_reduction(getattr(worker, name)))
                for name in dir(type(worker))
                if not name.startswith("_") and callable(getattr(worker, name))
            }
            described[role] = (worker.dispatch_info(), modes)
        return described

    def execute(self, role: str, method: str, payload: tuple[tuple, dict], collect: bool) -> Any:
        args, kwargs = payload
        out = getattr(self.workers[role], method)(*args, **kwargs)
        return to_host(out) if collect else None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(state, *args)` on this rank (checkpoint files, tests)."""
        return fn(self.state, *args)


def gather(
    refs: list,
    ranks: list[int],
    *,
    role: str,
    what: str,
    timeout_s: float,
    liveness: Liveness | None = None,
) -> dict[int, Any]:
    """Every ref's value by rank; a dead actor or a failed call raises naming role and rank
    (and its node, with `liveness`, which also ends the wait on a lost node)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    pending = dict(zip(refs, ranks))
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    nodes = liveness.nodes if liveness is not None else None
    while pending:
        left = max(0.0, deadline - time.monotonic())
        step = min(left, PING_PERIOD_S) if liveness is not None else left
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=step)
        if not ready and liveness is not None and left > step:
            liveness.check(sorted(pending.values()), role=role, what=what)
            continue
        if not ready:
            late = sorted(pending.values())
            raise RuntimeError(f"{role}: {what} did not return within {timeout_s:.0f} s on rank(s) {late}")
        ref = ready[0]
        rank = pending.pop(ref)
        try:
            results[rank] = ray.get(ref, timeout=0)
        except RayActorError as err:
            raise _died(role, rank, what, err, nodes) from err
        except GetTimeoutError:  # pragma: no cover - ready refs resolve at once
            pending[ref] = rank
        except Exception as err:
            # A peer's death often shows first as a broken collective here: name the dead one.
            dead = _first_dead(pending, FAILURE_GRACE_S)
            if dead is not None:
                raise _died(role, dead[0], what, dead[1], nodes) from dead[1]
            if liveness is not None:  # a peer on a lost node: its collective timed out here first
                liveness.raise_silent(sorted(pending.values()), FAILURE_GRACE_S, role=role, what=what)
            message = f"{role} worker rank {rank} failed in {what}: {_describe(err)}"
            raise WorkerCallError(message, role=role, rank=rank) from err
    return results


def _describe(err: BaseException) -> str:
    """A failed call's cause on one line, then the worker's traceback (without Ray's colours)."""
    cause = getattr(err, "cause", None)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    if cause is None:
        return text
    return f"{type(cause).__name__}: {cause}\n--- worker traceback ---\n{text}"


def _died(role: str, rank: int, what: str, err: BaseException, nodes=None) -> WorkerDiedError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = f" on node {nodes[rank]}" if nodes else ""
    return WorkerDiedError(
        f"{role} worker rank {rank}{where} died during {what} (its Ray actor is gone: {reason})",
        role=role,
        rank=rank,
    )


def _first_dead(pending: dict, grace_s: float) -> tuple[int, BaseException] | None:
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return None
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as err:
            return pending[ref], err
        except Exception:  # noqa: S112 - a peer's own failure: keep looking for a dead one
            continue
    return None


class ResourcePool:
    """A placement group of `num_bundles` identical bundles, one per rank of the roles it hosts.

    `strategy`: STRICT_PACK keeps a one-node pool on one node; PACK lets a multi-node pool span
    nodes (bundle i is rank i, so consecutive ranks share a node)."""

    def __init__(
        self, name: str, *, num_bundles: int, bundle: dict[str, float], strategy: str = "STRICT_PACK"
    ):
        assert num_bundles >= 1, num_bundles
        self.name, self.num_bundles, self.bundle, self.strategy = name, num_bundles, dict(bundle), strategy
        self.pg = None

    def create(self, timeout_s: float):
        import ray
        from ray.util.placement_group import placement_group

        self.pg = placement_group([dict(self.bundle)] * self.num_bundles, strategy=self.strategy)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"resource pool {self.name!r}: {self.num_bundles} x {self.bundle} ({self.strategy}) "
                f"could not be placed within {timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
            ) from None
        return self.pg

    def options(self, index: int) -> dict[str, Any]:
        """Actor options that put an actor on bundle `index`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.pg is not None, "create() the pool first"
        return dict(
            num_cpus=self.bundle.get("CPU", 0),
            num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=index
            ),
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class RankActors:
    """One `RankHost` actor per bundle of `pool`, named ``{pool}/rank{i}`` in the driver's
    namespace (``ray.get_actor("actor/rank1")`` finds one)."""

    def __init__(
        self, pool: ResourcePool, *, timeout_s: float = CALL_TIMEOUT_S, node_timeout_s: float | None = None
    ):
        import ray

        self.pool, self.timeout_s = pool, timeout_s
        pool.create(min(timeout_s, PLACEMENT_TIMEOUT_S))
        groups = {"concurrency_groups": {Liveness.GROUP: 1}} if node_timeout_s else {}
        host = ray.remote(**groups)(RankHost) if groups else ray.remote(RankHost)
        self.handles = [
            host.options(name=f"{pool.name}/rank{i}", max_restarts=0, **pool.options(i)).remote(
                i, pool.num_bundles
            )
            for i in range(pool.num_bundles)
        ]
        self.described: list[dict[str, tuple[DispatchInfo, dict]]] = []
        # `node_timeout_s`: a rank silent that long (its node lost) ends any wait on it (`Liveness`)
        self.liveness = None
        if node_timeout_s:
            nodes = self._all("where", [h.where.remote() for h in self.handles])
            self.liveness = Liveness(self.handles, nodes, node_timeout_s)
            logger.info("pool %s: rank actors on %s", pool.name, dict(enumerate(nodes)))

    @property
    def ranks(self) -> list[int]:
        return list(range(len(self.handles)))

    def _all(self, what: str, refs: list, role: str | None = None) -> list[Any]:
        ranks = list(range(len(refs)))  # refs[i] is rank i's
        out = gather(
            refs,
            ranks,
            role=role or self.pool.name,
            what=what,
            timeout_s=self.timeout_s,
            liveness=self.liveness,
        )
        return [out[r] for r in ranks]

    def init_distributed(self, backend: str, *, timeout_s: float) -> None:
        """The actors' own torch.distributed world; rank 0's actor picks address and port."""
        (addr, port), *_ = self._all("address", [self.handles[0].address.remote()])
        refs = [h.init_distributed.remote(backend, addr, port, timeout_s) for h in self.handles]
        self._all("init_process_group", refs)
        logger.info(
            "pool %s: %d ranks in a %s world at %s:%d", self.pool.name, len(self.handles), backend, addr, port
        )

    def setup(self, builder: Callable[..., Any], *args: Any) -> None:
        self.described = self._all("setup", [h.setup.remote(builder, *args) for h in self.handles])

    def run(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> list[Any]:
        """`fn(state, *args)` on every rank, all in flight together; results in rank order."""
        return self._all(
            what or getattr(fn, "__name__", "run"), [h.run.remote(fn, *args) for h in self.handles]
        )

    def group(self, role: str, *, timeout_s: float | None = None) -> RayWorkerGroup:
        assert self.described, "setup() the ranks first"
        infos = [d[role][0] for d in self.described]
        modes = self.described[0][role][1]
        return RayWorkerGroup(
            self.handles,
            role=role,
            infos=infos,
            modes=modes,
            timeout_s=timeout_s or self.timeout_s,
            liveness=self.liveness,
        )

    def shutdown(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        self.pool.remove()


class RayWorkerGroup:
    """`call()` like `SPMDWorkerGroup`, with the ranks as Ray actors and the driver collecting."""

    def __init__(
        self,
        handles: list,
        *,
        role: str,
        infos: list[DispatchInfo],
        modes: dict[str, tuple[Dispatch, str]],  # method -> (mode, metric reduction)
        timeout_s: float = CALL_TIMEOUT_S,
        liveness: Liveness | None = None,
    ):
        assert len(handles) == len(infos)
        self.handles, self.role, self.infos, self.modes, self.timeout_s = (
            handles,
            role,
            infos,
            modes,
            timeout_s,
        )
        self.liveness = liveness

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        if method_name not in self.modes:
            raise AttributeError(f"{self.role} worker has no method {method_name!r}")
        name, reduce = self.modes[method_name]
        mode = MODES[name]
        if not mode.gathers:
            payload = ray.put((args, kwargs))
            refs = [
                h.execute.remote(self.role, method_name, payload, r == 0) for r, h in enumerate(self.handles)
            ]
            return self._gather(refs, method_name)[0]
        batch, rest = args[0], args[1:]
        slots = [mode.slot(info) for info in self.infos]
        shares: dict[int, Any] = {}  # slot index -> object ref of its share (shared by its tp/pp ranks)
        for slot in slots:
            if slot.index not in shares:
                shares[slot.index] = ray.put(((mode.split(batch, slot), *rest), kwargs))
        refs = [
            h.execute.remote(self.role, method_name, shares[slot.index], slot.collects)
            for h, slot in zip(self.handles, slots)
        ]
        out = self._gather(refs, method_name)
        return mode.collect([(slot, out[r]) for r, slot in enumerate(slots) if slot.collects], reduce, batch)

    def _gather(self, refs: list, method_name: str) -> dict[int, Any]:
        ranks = list(range(len(refs)))
        return gather(
            refs, ranks, role=self.role, what=method_name, timeout_s=self.timeout_s, liveness=self.liveness
        )


class LocalWorkerGroup:
    """A worker in the driver itself (the reward worker when it is not fanned out)."""

    def __init__(self, worker: Any, *, role: str):
        self.worker, self.role = worker, role

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.worker, method_name, None)
        if method is None:
            raise AttributeError(f"{self.role} worker has no method {method_name!r}")
        return method(*args, **kwargs)


class PoolHost:
    """A CPU actor of a fan-out pool: builds one worker and runs its methods on chunks."""

    def __init__(self, builder: Callable[..., Any], *args: Any):
        self.worker = builder(*args)

    def execute(self, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return to_host(getattr(self.worker, method)(*args, **kwargs))

    def reductions(self) -> dict[str, str]:
        """How each method's metric dicts add up across slices (`register(..., metrics=)`)."""
        kind = type(self.worker)
        return {n: metrics_reduction(getattr(kind, n)) for n in dir(kind) if callable(getattr(kind, n))}


class FanOutGroup:
    """Scores a batch on a pool of stateless CPU actors: consecutive slices, one per actor,
    outputs merged back in order (`merge_outputs`, metric dicts reduced as the method
    declares: `RewardWorker.compute_reward` reports error counts, which add up)."""

    def __init__(
        self,
        pool: ResourcePool,
        builder: Callable[..., Any],
        *args: Any,
        role: str,
        timeout_s: float = CALL_TIMEOUT_S,
    ):
        import ray

        self.pool, self.role, self.timeout_s = pool, role, timeout_s
        pool.create(min(timeout_s, PLACEMENT_TIMEOUT_S))
        host = ray.remote(PoolHost)
        self.handles = [
            host.options(name=f"{pool.name}/worker{i}", max_restarts=0, **pool.options(i)).remote(
                builder, *args
            )
            for i in range(pool.num_bundles)
        ]
        self.reductions = gather(
            [self.handles[0].reductions.remote()], [0], role=role, what="describe", timeout_s=timeout_s
        )[0]

    def call(self, method_name: str, batch: DataBatch, *rest: Any, **kwargs: Any) -> Any:
        n = len(batch)
        num = max(1, min(len(self.handles), n))
        bounds = [n * i // num for i in range(num + 1)]
        refs = [
            self.handles[i].execute.remote(
                method_name, ((batch.slice(bounds[i], bounds[i + 1]), *rest), kwargs)
            )
            for i in range(num)
        ]
        out = gather(refs, list(range(num)), role=self.role, what=method_name, timeout_s=self.timeout_s)
        return merge_outputs([out[i] for i in range(num)], metrics=self.reductions.get(method_name, "mean"))

    def shutdown(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        self.pool.remove()
