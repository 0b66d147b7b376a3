"""Requests from many agents as few `RolloutEngine.generate` calls.

A request waits on a queue; one thread takes the first waiting request, then collects more for
`wait_s`, until `max_rows` samples are waiting, or until every running agent has a request in
(`live`: none can come before a reply), and generates each group of requests that share
sampling settings in one engine call (the engine batches prefill and decode over them).
Requests that arrive during a call form the next batch, so the engine is never idle while
requests wait, and a lone agent waits `wait_s` at most.

Calls are seeded from `seed` and a call counter (a fixed seed and the same batches give the same
samples); the batches themselves follow the agents' timing.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from rl3d.rollout.base import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Sample:
    """One generated response: ids, the engine's sampling log-probs and its raw (temperature 1)
    log-probs, which the trainer recomputes."""

    response_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float]
    finish_reason: str
    # per token, its most likely alternatives (token id, raw log-prob) when the request asked
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: Future = field(default_factory=Future)


@dataclass
class BatcherStats:
    calls: int = 0
    requests: int = 0
    rows: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "agent/generate_calls": float(self.calls),
            "agent/requests_per_call": self.requests / self.calls if self.calls else 0.0,
        }


class GenerateBatcher:
    """`submit(prompt_ids, params)` -> a Future of `params.n` `Sample`s; `close()` stops the thread
    after the call in progress (requests still queued fail)."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        max_rows: int = 64,
        wait_s: float = 0.005,
        seed: int | None = None,
        live: Callable[[], int] | None = None,
    ):
        self.engine, self.max_rows, self.wait_s, self.seed = engine, max_rows, wait_s, seed
        # how many agents are running: when every one of them waits on a request, no other
        # request can come, so the batch goes at once instead of after `wait_s`
        self.live = live
        self.stats = BatcherStats()
        self._queue: queue.Queue[_Request | None] = queue.Queue()  # None: close() wakes the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rl3d-agent-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future:
        request = _Request(list(prompt_ids), params)
        if self._stop.is_set():
            request.future.set_exception(
                RuntimeError("the rollout is over: the engine takes no more requests")
            )
        else:
            self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)  # wakes the thread if it waits for a first request
        self._thread.join()
        while not self._queue.empty():
            request = self._queue.get_nowait()
            if request is not None:
                request.future.set_exception(RuntimeError("the rollout ended before this request ran"))

    # -- the batching thread ------------------------------------------------------------------------
    def _collect(self) -> list[_Request]:
        first = self._queue.get()
        if first is None:  # close()
            return []
        batch, rows = [first], first.params.n
        deadline = time.monotonic() + self.wait_s
        while rows < self.max_rows:
            every_agent_in = self.live is not None and len(batch) >= self.live()
            left = 0.0 if every_agent_in else deadline - time.monotonic()  # 0: only what is queued
            try:
                request = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if request is None:  # close(): this batch still runs, then the loop ends
                break
            batch.append(request)
            rows += request.params.n
        return batch

    def _run(self) -> None:
        while not self._stop.is_set():
            groups: dict[SamplingParams, list[_Request]] = {}
            for request in self._collect():
                groups.setdefault(request.params, []).append(request)
            for params, requests in groups.items():
                self._generate(params, requests)

    def _generate(self, params: SamplingParams, requests: list[_Request]) -> None:
        if params.seed is None and self.seed is not None:
            params = dataclasses.replace(params, seed=(self.seed * _SEED_STRIDE + self.stats.calls) % 2**62)
        try:
            out = self.engine.generate([r.prompt_ids for r in requests], params)
        except Exception as err:  # a bad request fails its batch, never the thread
            logger.warning("agent endpoint: generate failed for %d requests: %s", len(requests), err)
            for r in requests:
                r.future.set_exception(err)
            return
        self.stats.calls += 1
        self.stats.requests += len(requests)
        self.stats.rows += len(out)
        ids, lps = out.responses(), out.token_logprobs()
        raws = out.token_logprobs(raw=True) if out.raw_logprobs is not None else lps
        index, tops = out.prompt_index.tolist(), out.token_top()
        if params.top_logprobs and tops is None:
            err = ValueError(f"the {type(self.engine).__name__} engine returns no top log-probs")
            for r in requests:
                r.future.set_exception(err)
            return
        samples: list[list[Sample]] = [[] for _ in requests]
        for row in range(len(out)):
            top = tops[row] if tops is not None else None
            samples[index[row]].append(Sample(ids[row], lps[row], raws[row], out.finish_reasons[row], top))
        for request, mine in zip(requests, samples):
            request.future.set_result(mine)
