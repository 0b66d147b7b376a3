"""Own resource pools under torchrun: each pool becomes its own torch.distributed world.

megatron-core keeps one global process-group grid per process, so two roles in different
layouts cannot share a world. When a recipe gives the critic or the reference its own pool
(`rl3d.config.pools`), `split_world` turns the torchrun world into one world per pool, the
way the Ray backend gives each pool its own world:

1. rank 0 picks an address and a free port for a TCPStore, and tells every rank over the
   torchrun world, which is then destroyed;
2. each rank joins its pool's world (rendezvous under the store's ``pool/<name>/`` prefix) as
   rank `world rank - pool.offset`, and megatron is initialised there as usual;
3. the controller, which still runs on every rank, talks across pools through a
   `ControllerChannel`: an object all-gather and a barrier over the same store.

A rank that dies leaves the others waiting on the store's keys until `timeout_s`, then they
fail with an error naming the missing rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import time
from typing import Any

import torch.distributed as dist

from rl3d.single_controller.pools import Pool, pool_of
from rl3d.utils.device import device_of_backend, init_process_group
from rl3d.utils.net import free_port

logger = logging.getLogger(__name__)


def _address() -> str:
    """Rank 0's address as the other ranks reach it: torchrun's MASTER_ADDR (rank 0's node),
    else this host's resolved name."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # pragma: no cover - a host without a resolvable name
        return "127.0.0.1"


class ControllerChannel:
    """Collectives of the controller over every rank of every pool, through a TCPStore.

    Round k's values live under ``ag/k/<rank>``; a rank deletes its round k-1 value once it has
    read every value of round k (by then every rank has finished reading round k-1)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.round = 0

    def _get(self, key: str, owner: int) -> bytes:
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # the store raises its own timeout type (DistStoreError)
            raise RuntimeError(
                f"controller channel: rank {owner} did not answer within {self.timeout_s:.0f} s "
                f"({key}); it died or is stuck"
            ) from err
        return self.store.get(key)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.round += 1
        self.store.set(f"ag/{self.round}/{self.rank}", pickle.dumps(obj))
        out = [pickle.loads(self._get(f"ag/{self.round}/{r}", r)) for r in range(self.world_size)]
        if self.round > 1:
            self.store.delete_key(f"ag/{self.round - 1}/{self.rank}")
        return out

    def barrier(self) -> None:
        self.all_gather_object(None)

    def any(self, flag: bool) -> bool:
        return any(self.all_gather_object(bool(flag)))


# How long a rank waits for another pool's answer. A pool waits through the others' whole
# phase of a step (the actor's generation and update), so this is generous, like the Ray
# backend's call timeout; a rank that dies ends the job at once anyway (torchrun stops the
# others). `RL3D_CONTROLLER_TIMEOUT_S` overrides it.
CHANNEL_TIMEOUT_S = float(os.environ.get("RL3D_CONTROLLER_TIMEOUT_S", 3600.0))


def split_world(
    pools: list[Pool], *, backend: str, timeout_s: float, channel_timeout_s: float | None = None
) -> tuple[Pool, ControllerChannel]:
    """On every torchrun rank: leave the torchrun world for this rank's pool world.

    `timeout_s` bounds the pool worlds' collectives; `channel_timeout_s` (default
    `CHANNEL_TIMEOUT_S`, at least `timeout_s`) the waits across pools."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pool = pool_of(pools, rank)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (_address(), free_port()) if rank == 0 else None)
    host, port = gathered[0]
    dist.destroy_process_group()

    started = time.perf_counter()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    # An explicit store: under torchrun, an init_method URL would look for torchrun's agent store.
    init_process_group(
        device_of_backend(backend),
        timeout_s=timeout_s,
        store=dist.PrefixStore(f"pool/{pool.name}/", store),
        rank=rank - pool.offset,
        world_size=pool.size,
    )
    wait_s = max(timeout_s, CHANNEL_TIMEOUT_S) if channel_timeout_s is None else channel_timeout_s
    channel = ControllerChannel(dist.PrefixStore("controller/", store), rank, world, wait_s)
    channel.barrier()
    logger.info(
        "pool %s: world rank %d is rank %d of %d (%s); %d pools joined in %.2f s",
        pool.name,
        rank,
        rank - pool.offset,
        pool.size,
        backend,
        len(pools),
        time.perf_counter() - started,
    )
    return pool, channel
