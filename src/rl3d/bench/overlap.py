"""The transition overlapped with the optimizer step, measured on real process groups.

The optimizer step is simulated: `step_s` seconds on every rank (all pipeline stages step at
once, each on its own ranks), spent in proportion to the parameters updated, as a sleep, so
the CPU stays free for the collectives' threads the way a GPU's optimizer kernels leave the
host free. (On a GPU the step's HBM traffic would contend with the copies; that is not
simulated.) Two schedules run side by side, alternating, in one launch:

- plain `hybridflow`: the whole step, then `to_generation`;
- overlap: `to_generation(on_bucket=step.update)`: each bucket of the micro-DP all-gather
  starts as soon as this rank's parameters in it are updated, while the next bucket updates.

The visible transition is the time from the end of the step (its slowest rank) to the end of
the transition (its slowest rank), or 0 when the transition ends first. The same number is
predicted by the modelled benchmark's `overlapped_seconds` from the plain transition time,
the number of buckets and the step's length; both are reported.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class SimulatedStep:
    """An optimizer step of `seconds` over this rank's parameters `numels` (name -> elements)."""

    def __init__(self, seconds: float, numels: dict[str, int]):
        self.seconds, self.numels = seconds, numels
        self.total = sum(numels.values()) or 1
        self.done: set[str] = set()
        self.buckets = 0
        self.end: float | None = None

    def _update(self, names: list[str]) -> None:
        self.done.update(names)
        share = sum(self.numels[n] for n in names) / self.total
        if share > 0:
            time.sleep(self.seconds * share)

    def update(self, params) -> None:
        """The executor's hook: update `params` (None: everything not yet updated)."""
        if params is None:
            self.finish()
            return
        self.buckets += 1
        self._update([p.name for p in params if p.name in self.numels and p.name not in self.done])

    def finish(self) -> None:
        self._update([n for n in self.numels if n not in self.done])
        if self.end is None:
            self.end = time.perf_counter()


def _max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _one(engine, shards: dict, step_s: float, overlap: bool, device) -> tuple[float, float, int]:
    """(visible seconds, step seconds, buckets) of one step + transition; slowest ranks."""
    step = SimulatedStep(step_s, {k: v.numel() for k, v in shards.items()})
    dist.barrier()
    start = time.perf_counter()
    if overlap:
        weights = engine.to_generation(shards, on_bucket=step.update)
        step.finish()  # a rank with no bucket to move still steps
    else:
        step.finish()
        weights = engine.to_generation(shards)
    done = time.perf_counter()
    if weights is not None:
        weights.release()
    step_end = _max(step.end - start, device)
    done_end = _max(done - start, device)
    return max(done_end - step_end, 0.0), step_end, int(_max(step.buckets, device))


def measure_overlap(engine, shards: dict, step_s: float, *, repeats: int, warmup: int, device) -> dict:
    """Plain vs overlapped, alternating run by run; medians and every run."""
    from rl3d.bench.modeled import overlapped_seconds

    runs: dict[str, list[tuple[float, float, int]]] = {"plain": [], "overlap": []}
    for k in range(warmup + repeats):
        for mode in ("plain", "overlap"):
            got = _one(engine, shards, step_s, mode == "overlap", device)
            if k >= warmup:
                runs[mode].append(got)
    plain = statistics.median(v for v, _, _ in runs["plain"])
    visible = statistics.median(v for v, _, _ in runs["overlap"])
    buckets = max(b for _, _, b in runs["overlap"])
    return {
        "strategy": engine.strategy,
        "step_seconds": step_s,
        "measured_step_seconds": statistics.median(s for _, s, _ in runs["overlap"]),
        "buckets": buckets,
        "plain_visible_seconds": plain,
        "overlap_visible_seconds": visible,
        "ratio": visible / plain if plain > 0 else None,
        "modeled_visible_seconds": overlapped_seconds(plain, buckets, step_s),
        "plain_runs": [v for v, _, _ in runs["plain"]],
        "overlap_runs": [v for v, _, _ in runs["overlap"]],
    }
