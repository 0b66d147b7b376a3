"""Over-sampling on a separate rollout pool's rank (`rollout.async.oversample`, see
`rl3d.config.async_rollout`): a step does not wait for its slowest samples.

A rank needs `need` prompt groups (its share of a step, `rollout.n` samples each) per step and
keeps `ceil(need * oversample)` groups in flight. Each step one engine call generates every
unfinished sample of the groups carried from earlier steps (continued from the tokens it has:
prompt + those tokens are the engine's prompt, for the tokens left of `rollout.max_new_tokens`)
and the samples of the new prompts drawn to fill up, and ends as soon as enough groups are
complete (`TorchRolloutEngine.early_stop`). The step trains on the `need` oldest complete groups;
the others, complete or not, are carried to the next step. Every token keeps the policy version
it was sampled with (`policy_version`) and its rollout log-prob, which the trainer's off-policy
correction (`algorithm.rollout_correction`) weighs it by. A carried group whose oldest token
would be more than `rollout.async.drop_staleness` versions behind the policy that trains on it
is dropped instead of trained on.

Metrics (per step, summed over the pool's ranks): `rollout/in_flight` (groups the step's call
held, complete carried ones included), `rollout/oversampled` (of those, beyond what the step
needs), `rollout/carried` (groups carried to the next step), `rollout/carried_trained` (groups
trained on that began in an earlier step), `rollout/stale_dropped`, `rollout/aborted_samples`
(samples the early stop left unfinished, to be continued).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl3d.config.async_rollout import staleness_bound
from rl3d.rollout.torch_engine import FINISH_ABORTED, EarlyStop
from rl3d.single_controller.batch import PROMPT_WIDTH, DataBatch
from rl3d.workers.generation import prompt_width, rollout_sampling, rows_to_batch
from rl3d.workers.rollout_worker import POLICY_VERSION


@dataclass
class Sample:
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each token's policy version
    finish: str | None = None  # None: not finished (continued by the next call)


@dataclass(eq=False)
class Group:
    prompt: DataBatch  # the prompt's row (uid, index, what the reward reads)
    samples: list[Sample]
    began: int  # the step that started it

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> int | None:
        versions = [v for s in self.samples for v in s.versions]
        return min(versions) if versions else None


class OverSampler:
    """A rollout rank's over-sampled generation (see the module docstring)."""

    def __init__(self, cfg: Any, worker: Any):
        ro = cfg.rollout
        self.cfg, self.worker = cfg, worker
        self.n, self.max_new, self.factor = ro.n, ro.max_new_tokens, ro.async_.oversample
        self.cut = staleness_bound(cfg)
        # the prompt columns: the trained groups' own widest prompt with one engine; with several,
        # one width on every rank (their rows are concatenated)
        self.width = cfg.data.max_prompt_length if ro.pool.dp > 1 else 0
        self.carried: list[Group] = []  # started, not trained on yet (oldest first)
        self.queue: list[DataBatch] = []  # drawn, not started (one prompt each)
        self.need: int | None = None

    def generate(
        self, draw: Callable[[], DataBatch], *, step: int, seed: int
    ) -> tuple[DataBatch | None, dict[str, float]]:
        """Step `step`'s rows (`need` complete groups) and its counts; `draw()` returns this
        rank's share of the sampler's next batch (uids set)."""
        trains_on = step - 1  # the policy version that trains on this step's samples
        stale = [g for g in self.carried if (g.oldest() is not None and trains_on - g.oldest() > self.cut)]
        groups = [g for g in self.carried if g not in stale]
        if self.need is None:
            self.queue += _rows(draw())
            self.need = len(self.queue)
        need = self.need
        while len(groups) < math.ceil(need * self.factor - 1e-9):
            if not self.queue:
                self.queue += _rows(draw())
            groups.append(Group(self.queue.pop(0), [Sample() for _ in range(self.n)], step))
        ready = sum(g.complete for g in groups)
        aborted = 0
        if ready < need:
            aborted = self._run([g for g in groups if not g.complete], need - ready, seed)
        done = [g for g in groups if g.complete][:need]
        self.carried = [g for g in groups if g not in done]
        counts = {
            "rollout/in_flight": len(groups),
            "rollout/oversampled": max(0, len(groups) - need),
            "rollout/carried": len(self.carried),
            "rollout/carried_trained": sum(g.began < step for g in done),
            "rollout/stale_dropped": len(stale),
            "rollout/aborted_samples": aborted,
        }
        return self._batch(done), {k: float(v) for k, v in counts.items()}

    def _run(self, running: list[Group], target: int, seed: int) -> int:
        """One engine call over every unfinished sample of `running`, ended once `target` of the
        groups are complete; the samples extended in place. Returns the samples left unfinished."""
        worker = self.worker
        rows, owners, groups, limits = [], [], [], []
        for g_index, group in enumerate(running):
            prompt = list(group.prompt["prompt_ids"][0])
            for sample in group.samples:
                if sample.finish is None:
                    rows.append(prompt + sample.ids)
                    owners.append(sample)
                    groups.append(g_index)
                    limits.append(self.max_new - len(sample.ids))
        params = rollout_sampling(self.cfg, step=seed, gen_dp_rank=worker.dp_rank)
        params = dataclasses.replace(params, n=1, max_new_tokens=max(limits))
        engine = worker.engine
        engine.early_stop = EarlyStop(groups, limits, target)
        worker._chunk_versions = []  # the version of each token's logits (one chunk)
        try:
            out = engine.generate(rows, params)
        finally:
            engine.early_stop = None
        versions = worker._chunk_versions[0]
        logps = out.token_logprobs(raw=out.raw_logprobs is not None)  # what the trainer recomputes
        for sample, ids, lps, finish in zip(owners, out.responses(), logps, out.finish_reasons):
            sample.versions += versions[: len(ids)]
            sample.ids += ids
            sample.logps += lps
            sample.finish = None if finish == FINISH_ABORTED else finish
        return sum(s.finish is None for s in owners)

    def _batch(self, done: list[Group]) -> DataBatch | None:
        if not done:
            return None
        prompts = DataBatch.concat([g.prompt for g in done])
        prompts.info[PROMPT_WIDTH] = max(self.width, prompt_width(prompts))
        rows = [(p, s.ids, s.logps, s.finish) for p, g in enumerate(done) for s in g.samples]
        batch = rows_to_batch(prompts, rows, self.worker.pad_token_id)
        version_BR = torch.full(batch["responses"].shape, self.worker.version, dtype=torch.long)
        for i, (_, sample) in enumerate((p, s) for p, g in enumerate(done) for s in g.samples):
            version_BR[i, : len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
        return batch.set(POLICY_VERSION, version_BR)


def _rows(batch: DataBatch) -> list[DataBatch]:
    return [batch.select([i]) for i in range(len(batch))]
