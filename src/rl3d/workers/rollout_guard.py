"""Failure containment on a separate rollout pool's rank (`rollout.timeout_s`, see
`rl3d.config.async_rollout`).

`ContainedGeneration` generates a rank's share of a step prompt by prompt (a prompt's `n`
samples in one engine call, seeded per prompt), each call in a thread the rank waits on for at
most `rollout.timeout_s`. A call that raises or runs past the deadline does not end the rank:
- past the deadline the engine is told to stop (the call's cancel event, checked before each
  decode step: `RolloutWorker.call`); one that does not stop within another `timeout_s` is
  lost and rebuilt;
- an engine that raised is rebuilt from the last weights the rank received, when
  `rollout.max_restarts` allows (`RolloutWorker.restart_engine`; past the bound the rank stops
  with an error naming pool, rank and cause, which ends the run);
- the prompt is then issued once more (`rollout.reissue`), and dropped if that fails too.
The rank reports what it dropped, re-issued and restarted with its part; the trainer checks
`rollout.min_fraction` (`rl3d.controller.placement.SeparatePool.first_round`).

`RL3D_TEST_ROLLOUT_FAULTS` injects faults for tests only (`faults_from_env`): `hang:S:P:SECONDS`
makes the generation of prompt P of this rank's share at step S sleep inside the engine on every
attempt; `raise:S` makes the engine raise once, on the first prompt of step S.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rl3d.single_controller.batch import PROMPT_WIDTH, DataBatch
from rl3d.single_controller.dispatch import INPUT_ROW
from rl3d.workers.generation import prompt_width

logger = logging.getLogger(__name__)
FAULTS_ENV = "RL3D_TEST_ROLLOUT_FAULTS"
SEEDS_PER_STEP = 4096  # a prompt's seed: the step's seed * SEEDS_PER_STEP + its place in the share


class Cancelled(RuntimeError):
    """Raised inside the engine when the rank gave up waiting for its call."""


class RolloutRankFailed(RuntimeError):
    """The rank cannot go on (engine restarts past `rollout.max_restarts`): ends the run."""


@dataclass
class Faults:
    """Injected faults (tests only): {step: {prompt: seconds}} hangs, steps whose engine raises."""

    hangs: dict[int, dict[int, float]] = field(default_factory=dict)
    raises: set[int] = field(default_factory=set)

    def before_call(self, step: int, prompt: int) -> tuple[float, bool]:
        """(seconds to hang, whether to raise) for this call; a raise happens once."""
        raise_now = prompt == 0 and step in self.raises
        if raise_now:
            self.raises.discard(step)
        return self.hangs.get(step, {}).get(prompt, 0.0), raise_now


def faults_from_env(env: dict[str, str] | None = None) -> Faults:
    """Parse `RL3D_TEST_ROLLOUT_FAULTS` (';'-separated `hang:S:P:SECONDS` and `raise:S`)."""
    text = (os.environ if env is None else env).get(FAULTS_ENV, "")
    faults = Faults()
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *args = item.split(":")
        if kind == "hang" and len(args) == 3:
            faults.hangs.setdefault(int(args[0]), {})[int(args[1])] = float(args[2])
        elif kind == "raise" and len(args) == 1:
            faults.raises.add(int(args[0]))
        else:
            raise ValueError(f"{FAULTS_ENV}: cannot read {item!r} (hang:STEP:PROMPT:SECONDS or raise:STEP)")
    return faults


@dataclass
class Counts:
    dropped: int = 0  # prompts of the share that did not arrive
    reissued: int = 0  # calls issued a second time
    restarts: int = 0  # engines rebuilt

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in vars(self).items()}


class ContainedGeneration:
    """A rollout rank's generation with failures contained (see the module docstring)."""

    def __init__(self, cfg: Any, worker: Any, faults: Faults | None = None):
        self.worker, self.timeout_s = worker, float(cfg.rollout.timeout_s)
        self.reissue, self.max_restarts = cfg.rollout.reissue, cfg.rollout.max_restarts
        self.faults = faults_from_env() if faults is None else faults
        self.restarts = 0  # over the run: bounded by rollout.max_restarts

    def generate(self, prompts: DataBatch, *, step: int, seed: int) -> tuple[DataBatch | None, Counts]:
        """This rank's share of step `step` (its first round, seeded `seed`): the rows of every
        prompt that arrived, in the share's order, and what was dropped, re-issued, restarted."""
        counts, outs = Counts(), []
        prompts.info.setdefault(PROMPT_WIDTH, prompt_width(prompts) if len(prompts) else 0)
        for i in range(len(prompts)):
            one = prompts.select([i])
            out = self._attempt(one, step, i, seed * SEEDS_PER_STEP + i, counts)
            if out is None and self.reissue:
                counts.reissued += 1
                out = self._attempt(one, step, i, seed * SEEDS_PER_STEP + i, counts)
            if out is None:
                counts.dropped += 1
                continue
            out.tensors[INPUT_ROW] = torch.full_like(out[INPUT_ROW], i)  # its row in the share
            outs.append(out)
        if counts.dropped:
            logger.warning(
                "rollout pool rank %d: step %d: %d of %d prompts dropped",
                self.worker.pool_rank,
                step,
                counts.dropped,
                len(prompts),
            )
        return (DataBatch.concat(outs) if outs else None), counts

    def _attempt(self, one: DataBatch, step: int, prompt: int, seed: int, counts: Counts) -> DataBatch | None:
        """One engine call for one prompt in a thread; None if it raised or ran past the deadline."""
        worker, result, cancel = self.worker, {}, threading.Event()
        hang_s, raise_now = self.faults.before_call(step, prompt)

        def call() -> None:
            worker.call.cancel, worker.call.hang_s, worker.call.raise_now = cancel, hang_s, raise_now
            try:
                result["out"] = worker.generate(one, step=seed)
            except BaseException as err:  # noqa: BLE001 - handed to the rank's thread
                result["error"] = err

        thread = threading.Thread(target=call, name=f"rollout-step{step}-prompt{prompt}", daemon=True)
        began = time.monotonic()
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            cancel.set()  # the engine stops at its next decode step
            thread.join(self.timeout_s)
            cause = f"step {step} prompt {prompt}: no answer within rollout.timeout_s = {self.timeout_s:g} s"
            logger.warning("rollout pool rank %d: %s", worker.pool_rank, cause)
            if thread.is_alive():  # stuck inside the engine: the engine is lost
                self._restart(f"{cause}, and the engine did not stop", counts)
            return None
        error = result.get("error")
        if error is None:
            return result["out"]
        if isinstance(error, Cancelled):  # the deadline passed while it was still running
            return None
        cause = f"step {step} prompt {prompt}: {type(error).__name__}: {error}"
        logger.warning(
            "rollout pool rank %d: %s (after %.1f s)", worker.pool_rank, cause, time.monotonic() - began
        )
        if self.max_restarts:
            self._restart(cause, counts)
        return None

    def _restart(self, cause: str, counts: Counts) -> None:
        """Rebuild the engine from the last weights received, within `rollout.max_restarts`."""
        if self.restarts >= self.max_restarts:
            raise RolloutRankFailed(
                f"rollout pool rank {self.worker.pool_rank}: engine failed after "
                f"{self.restarts} restarts (rollout.max_restarts = {self.max_restarts}): {cause}"
            )
        self.restarts += 1
        counts.restarts += 1
        self.worker.restart_engine()
        logger.warning(
            "rollout pool rank %d: engine rebuilt from policy version %d (restart %d of %d)",
            self.worker.pool_rank,
            self.worker.version,
            self.restarts,
            self.max_restarts,
        )
