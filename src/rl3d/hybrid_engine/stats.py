"""What a transition reports: its counted bytes and calls, the memory it added, its seconds, and
with `Resharder(time_phases=True)` where those seconds went, phase by phase (`PhaseClock`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from rl3d.hybrid_engine.comm import DeltaCounts


@dataclass(frozen=True)
class TransitionStats:
    strategy: str
    recv_bytes: int
    send_bytes: int
    peak_param_bytes: int  # generation weights' distinct storage (buffers + reused shards)
    seconds: float
    verified: bool
    recv_from: dict[int, int] = field(default_factory=dict)  # sender -> logical bytes received
    calls: int = 0  # calls this rank issued (`CommCounter.calls`: a batched phase is one)
    # storage the transition allocated for the generation weights (the training tensors read
    # in place are not counted): 0 for an identity transition
    alloc_bytes: int = 0
    messages: int = 0  # messages received with bytes in them (`CommCounter.messages`)
    # with `Resharder(time_phases=True)`: seconds per phase, summed over buckets (`PHASES`)
    phases: dict[str, float] = field(default_factory=dict)
    # the push to an engine that keeps its own copy as HF tensors (`engine_push`): 0 without one
    engine_bytes: int = 0
    engine_buckets: int = 0
    engine_gather_bytes: int = 0
    engine_seconds: float = 0.0
    delta: DeltaCounts | None = None  # a weight sync sent as deltas (rl3d.weight_sync.delta)

    def metrics(self) -> dict[str, float]:
        """`reshard/peak_bytes` is the memory the transition adds on top of the training
        weights; `reshard/gen_bytes` all of the generation weights, in-place pieces included.
        `reshard/engine_*` count the push (the plan's, checked): bytes handed to the engine, its
        buckets, bytes received in the generation-TP group to make whole tensors, its seconds."""
        return {
            "reshard/bytes": self.recv_bytes,
            "reshard/send_bytes": self.send_bytes,
            "reshard/peak_bytes": self.alloc_bytes,
            "reshard/gen_bytes": self.peak_param_bytes,
            "reshard/seconds": self.seconds,
            "reshard/engine_bytes": self.engine_bytes,
            "reshard/engine_buckets": self.engine_buckets,
            "reshard/engine_gather_bytes": self.engine_gather_bytes,
            "reshard/engine_seconds": self.engine_seconds,
        }


# What `time_phases` times: the generation buffer's allocation and its views (the peers' shards
# land in place, so this is all hybridflow's unpacking is), packing the rank's own shards, the
# collectives (waits included), point-to-point phases (packing and unpacking included), and
# assembling the generation weights from pieces. The plan is made once, at construction
# (`Resharder.plan_seconds`).
PHASES = ("buffer", "pack", "collective", "p2p", "assemble")


class PhaseClock:
    """Seconds per phase of the running transition, summed over its buckets: `start()`, then
    `with clock.phase(name): ...` around each part, then `stop()` returns them. Off, it times
    nothing and `stop()` returns {}."""

    def __init__(self, on: bool):
        self.on = on
        self._phases: dict[str, float] | None = None  # this transition's, while it runs

    def start(self) -> None:
        self._phases = {} if self.on else None

    def stop(self) -> dict[str, float]:
        phases, self._phases = self._phases or {}, None
        return phases

    @contextmanager
    def phase(self, name: str):
        if self._phases is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - start
