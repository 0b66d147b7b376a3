"""The trainer <-> rollout-pool protocol of `rollout.placement: separate`, over the TCPStore the
pools share (`rl3d.single_controller.spmd_pools`). Small things only: the start position,
"weights of version v follow", finished batches and the stop flag. The weights themselves go
over a process group (`rl3d.weight_sync`).

Keys (under ``async/``):
- ``start``: {"step", "sampler"} from training rank 0: where the run starts (or resumed);
- ``weights/<v>``: the trainer is sending policy version v (v = the number of updates made);
- ``batch/<k>/<dp>``: step k's samples from generation-DP rank dp, with its timings;
- ``stop``: the trainer is done; ``failed``: a rank of either pool failed (its line);
- ``request/<n>``, ``reply/<n>/<dp>``: the trainer's n-th generation request (an extra rollout
  round, validation: prompts, seed, greedy, the policy version to use) and each engine's answer;
- ``position/<k>``: with dynamic sampling, the trainer's sampler position where step k starts.

Under Ray the driver serves the store and runs the trainer's side; a rollout rank actor that
dies writes no ``failed`` line, so the driver's link is given a `check` that raises naming it
(`rl3d.launch.ray_rollout_pool`), called every `CHECK_EVERY_S` of a wait.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

POLL_S = 0.002
CHECK_EVERY_S = 0.2


class AsyncLinkError(RuntimeError):
    pass


class AsyncLink:
    def __init__(self, store: Any, *, timeout_s: float, who: str, check: Callable[[], None] = lambda: None):
        self.store = dist.PrefixStore("async/", store)
        self.timeout_s, self.who = timeout_s, who  # who: "training rank 0", "rollout rank 1", ...
        self.check = check  # raises if the other side is known dead (the Ray driver's watch)

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _wait(self, key: str, what: str) -> bytes:
        """Wait for `key`, failing early when the other pool reports a failure."""
        deadline = time.monotonic() + self.timeout_s
        checked = time.monotonic()
        while not self._has(key):
            if self._has("failed"):
                raise AsyncLinkError(self.store.get("failed").decode())
            if time.monotonic() - checked > CHECK_EVERY_S:
                self.check()
                checked = time.monotonic()
            if time.monotonic() > deadline:
                raise AsyncLinkError(f"{self.who}: {what} did not come within {self.timeout_s:.0f} s ({key})")
            time.sleep(POLL_S)
        return self.store.get(key)

    # -- start / stop ----------------------------------------------------------------------------
    def put_start(self, step: int, sampler_state: dict) -> None:
        self.store.set("start", pickle.dumps({"step": step, "sampler": sampler_state}))

    def get_start(self) -> dict:
        return pickle.loads(self._wait("start", "the trainer's start position"))

    def stop(self) -> None:
        self.store.set("stop", b"1")

    def stopped(self) -> bool:
        return self._has("stop")

    def ack_stop(self, pool_rank: int) -> None:
        self.store.set(f"done/{pool_rank}", b"1")

    def wait_acks(self, num_ranks: int, timeout_s: float) -> None:
        """On training rank 0 (it serves the store): let the rollout ranks see the stop before
        the store goes away with this process."""
        deadline = time.monotonic() + timeout_s
        while not all(self._has(f"done/{r}") for r in range(num_ranks)) and time.monotonic() < deadline:
            try:
                self.check()  # a rollout rank known dead (Ray) will not answer
            except Exception:  # noqa: BLE001 - the run's own error is already on its way
                return
            time.sleep(POLL_S)

    def fail(self, line: str) -> None:
        try:
            self.store.compare_set("failed", "", line)  # the first failure is the cause
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass

    # -- weights ---------------------------------------------------------------------------------
    def announce_weights(self, version: int) -> None:
        self.store.set(f"weights/{version}", b"1")

    def weights_announced(self, version: int) -> bool:
        return self._has(f"weights/{version}")

    def wait_weights(self, version: int, who: str) -> None:
        self._wait(f"weights/{version}", f"policy version {version} ({who})")

    # -- batches ---------------------------------------------------------------------------------
    def put_part(self, step: int, dp_rank: int, part: Any) -> None:
        self.store.set(f"batch/{step}/{dp_rank}", pickle.dumps(part))

    def get_parts(self, step: int, num_parts: int, pool_ranks: list[int]) -> list[Any]:
        out = []
        for dp in range(num_parts):
            what = f"step {step}'s samples from the rollout pool (world rank {pool_ranks[dp]})"
            out.append(pickle.loads(self._wait(f"batch/{step}/{dp}", what)))
        return out

    def drop_parts(self, step: int, num_parts: int) -> None:
        """Free a step's parts (every training rank has read them: call two steps later)."""
        for dp in range(num_parts):
            self.store.delete_key(f"batch/{step}/{dp}")

    # -- generation requests and step positions --------------------------------------------------
    def put_request(self, n: int, request: dict) -> None:
        self.store.set(f"request/{n}", pickle.dumps(request))

    def has_request(self, n: int) -> bool:
        return self._has(f"request/{n}")

    def get_request(self, n: int) -> dict:
        return pickle.loads(self._wait(f"request/{n}", f"generation request {n}"))

    def put_reply(self, n: int, dp_rank: int, part: Any) -> None:
        self.store.set(f"reply/{n}/{dp_rank}", pickle.dumps(part))

    def get_replies(self, n: int, num_parts: int, pool_ranks: list[int]) -> list[Any]:
        out = []
        for dp in range(num_parts):
            what = f"generation request {n} (world rank {pool_ranks[dp]})"
            out.append(pickle.loads(self._wait(f"reply/{n}/{dp}", what)))
        return out

    def drop_request(self, n: int, num_parts: int) -> None:
        for key in [f"request/{n}", *(f"reply/{n}/{dp}" for dp in range(num_parts))]:
            self.store.delete_key(key)

    def put_position(self, step: int, sampler_state: dict) -> None:
        self.store.set(f"position/{step}", pickle.dumps(sampler_state))

    def has_position(self, step: int) -> bool:
        return self._has(f"position/{step}")

    def get_position(self, step: int) -> dict:
        return pickle.loads(self._wait(f"position/{step}", f"step {step}'s sampler position"))

    def drop_position(self, step: int) -> None:
        self.store.delete_key(f"position/{step}")
