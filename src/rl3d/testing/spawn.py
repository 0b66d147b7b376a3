"""Run a function on several gloo processes, the way tests in `tests/distributed` need it.

    results = run_distributed(fn, 4, arg1, arg2, timeout_s=120)

`fn(rank, world_size, *args)` runs in a fresh spawned process per rank with torch.distributed
initialised (gloo, tcp://127.0.0.1:<free port>) and one torch thread. The return values (which
must pickle) come back as a list in rank order. If any rank raises, `DistributedTestError`
carries that rank's traceback; a rank that hangs past `timeout_s` fails the call too.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl3d.utils.net import free_port  # the tests' rendezvous port too


class DistributedTestError(RuntimeError):
    """A spawned rank failed; the message holds its traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    timeout_s: float,
) -> None:
    import datetime

    torch.set_num_threads(1)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, _to_bytes(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; their results in rank order.

    `fn` must be importable by name (a module-level function) since ranks are spawned.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, queue, timeout_s))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        deadline = _deadline(timeout_s)
        while len(results) + len(failures) < world_size:
            if not _wait_for_item(queue, procs, deadline):
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                if failures:
                    break  # the others are likely blocked on the failed rank
                raise DistributedTestError(f"ranks {missing} gave no result within {timeout_s}s")
            rank, ok, value = queue.get()
            if ok:
                results[rank] = _from_bytes(value)
            else:
                failures[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        first = min(failures)
        raise DistributedTestError(f"rank {first} of {world_size} failed:\n{failures[first]}")
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def one_rank_world(timeout_s: float = 60.0) -> Iterator[None]:
    """A one-process gloo world for the block, in this process (for a fixture); none is made, or
    destroyed, when a world exists already."""
    owns_world = not dist.is_initialized()
    if owns_world:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    try:
        yield
    finally:
        if owns_world:
            dist.destroy_process_group()


def _to_bytes(value: Any) -> bytes:
    # Tensors put on a multiprocessing queue travel as shared-memory handles that die with the
    # sending process; serialised bytes outlive a rank that exits right after returning.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _deadline(timeout_s: float) -> float:
    import time

    return time.monotonic() + timeout_s


def _wait_for_item(queue: Any, procs: list, deadline: float) -> bool:
    """Poll until the queue has an item (True), or the deadline passes / all processes died."""
    import time

    while time.monotonic() < deadline:
        if not queue.empty():
            return True
        if all(not p.is_alive() for p in procs) and queue.empty():
            time.sleep(0.2)  # a last item may still be in flight
            return not queue.empty()
        time.sleep(0.05)
    return False
