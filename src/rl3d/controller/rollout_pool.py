"""The rollout pool's side of `rollout.placement: separate` (the trainer's is
`rl3d.controller.placement.SeparatePool`).

Each rank of the pool runs `RolloutPoolRunner`: it serves the trainer's generation requests
first; else generates the next step's first round ahead from its own copy of the sampler as
soon as the staleness bound allows (with dynamic sampling, from the trainer's sampler position
after the previous step's rounds); else takes in the newest weights the trainer sent. Both
backends run it (a Ray rollout rank actor too).
"""

from __future__ import annotations

import logging
import time

from rl3d.controller.placement import GEN, follows_trainer, round_seed, round_uids
from rl3d.rollout.torch_engine import GenerationStats
from rl3d.single_controller.async_link import POLL_S, AsyncLink, AsyncLinkError
from rl3d.single_controller.dispatch import Slot

logger = logging.getLogger(__name__)
OVERSAMPLED_UID = 10**12  # over-sampled prompts' uids: apart from any step's rounds (step * 10**6 + ...)


class RolloutPoolRunner:
    """The loop of a rollout-pool rank (its `fit` returns no metrics)."""

    def __init__(self, cfg, worker, sampler, link: AsyncLink, world_rank: int):
        from rl3d.config.async_rollout import contains_failures, oversamples
        from rl3d.workers.oversample import OverSampler
        from rl3d.workers.rollout_guard import ContainedGeneration

        self.cfg, self.worker, self.sampler, self.link = cfg, worker, sampler, link
        self.world_rank = world_rank
        # rollout.timeout_s: a step's samples each with a deadline, failures dropped or re-issued
        self.contained = ContainedGeneration(cfg, worker) if contains_failures(cfg) else None
        # rollout.async.oversample: more prompts in flight than a step needs, the rest carried
        self.oversampler = OverSampler(cfg, worker) if oversamples(cfg) else None
        self.drawn = 0  # sampler batches drawn (over-sampling draws as it needs)

    def fit(self) -> list[dict[str, float]]:
        try:
            self._loop()
            self.link.ack_stop(self.worker.pool_rank)
        except BaseException as err:
            rank = self.worker.pool_rank
            self.link.fail(
                f"rollout pool rank {rank} (world rank {self.world_rank}) failed: {type(err).__name__}: {err}"
            )
            raise
        return []

    def _loop(self) -> None:
        """Serve the trainer's requests first; else generate the next step ahead as soon as the
        staleness bound (and, with dynamic sampling, the trainer's sampler position) allows;
        else take in new weights; until the trainer stops."""
        cfg, worker, link = self.cfg, self.worker, self.link
        timeout, staleness = cfg.rollout.async_.timeout_s, cfg.rollout.async_.max_staleness
        start = link.get_start()
        self.sampler.sampler.load_state_dict(start["sampler"])
        first = start["step"] + 1
        worker.version = first - 2  # the trainer sends its current policy (a resumed one: not 0) first
        if not worker.wait_for(first - 1, timeout):
            return
        self.slot = Slot(worker.dp_rank, cfg.rollout.pool.dp, worker.tp_rank == 0)
        self.next_request, self.pending = 0, None
        follows, last = follows_trainer(cfg), cfg.trainer.total_steps
        step, idle, held = first, time.monotonic(), 0.0  # held: time the next step was held back
        while True:
            began = time.monotonic()
            if self._serve_request():
                held, idle = held + began - idle, time.monotonic()  # serving is not being held back
                continue
            ready = step <= last and worker.version >= step - 1 - staleness  # the staleness bound
            if ready and (not follows or step == first or worker.agree(link.has_position(step))):
                if follows and step > first:  # the trainer's sampler after step - 1's rounds
                    self.sampler.sampler.load_state_dict(link.get_position(step))
                self._generate_step(step, held + time.monotonic() - idle)
                step, idle, held = step + 1, time.monotonic(), 0.0
                continue
            if worker.poll():
                continue
            if worker.stopped():
                return
            if step <= last and time.monotonic() - idle > timeout:
                what = f"step {step}'s prompts" if ready else f"policy version {step - 1 - staleness}"
                raise AsyncLinkError(
                    f"rollout pool rank {worker.pool_rank}: {what} did not come within {timeout:.0f} s"
                )
            time.sleep(POLL_S if step <= last else 0.01)

    def _generate_step(self, step: int, waited: float) -> None:
        """Step `step`'s first round from this rank's copy of the sampler, handed over."""
        began, cpu_began = time.perf_counter(), time.process_time()
        self.worker.engine.stats = GenerationStats()  # this step's engine work (none: no call)
        if self.oversampler is not None:
            part, counts = self.oversampler.generate(self._draw, step=step, seed=round_seed(step, 0))
            self._hand_over(step, part, counts, waited, began, cpu_began)
            return
        prompts = self.sampler.next_batch()
        prompts.set("uid", round_uids(step, 0, len(prompts)))  # the colocated loop's
        share, counts = GEN.split(prompts, self.slot), {}
        if self.contained is None:
            part = self.worker.generate(share, step=round_seed(step, 0))
        else:
            part, contained = self.contained.generate(share, step=step, seed=round_seed(step, 0))
            counts = contained.metrics()
        self._hand_over(step, part, counts, waited, began, cpu_began)

    def _draw(self):
        """This rank's share of the sampler's next batch, each prompt a uid of its own (the
        batch's number: ranks draw at their own pace, every rank's copy of the sampler alike)."""
        prompts = self.sampler.next_batch()
        prompts.set("uid", [OVERSAMPLED_UID + self.drawn * 100_000 + i for i in range(len(prompts))])
        self.drawn += 1
        return GEN.split(prompts, self.slot)

    def _hand_over(self, step, part, counts, waited: float, began: float, cpu_began: float) -> None:
        info = {
            "wait_rollout_s": waited,
            "generate_s": time.perf_counter() - began,
            "generate_cpu_s": time.process_time() - cpu_began,  # this rank's work, however busy the host
            "counts": counts,  # rollout/dropped, reissued, restarts with failure containment
        }
        if self.contained is None:  # the step's one engine call (its work, however busy the host)
            stats = self.worker.engine.stats
            info |= {"decode_steps": stats.decode_steps, "decode_rows": stats.decode_rows}
        if self.slot.collects:
            self.link.put_part(step, self.worker.dp_rank, (self.slot, part, info))

    def _serve_request(self) -> bool:
        """Answer the trainer's next generation request once this rank holds its version."""
        worker, n = self.worker, self.next_request
        if self.pending is None:
            if not worker.agree(self.link.has_request(n)):
                return False
            self.pending = self.link.get_request(n)
        request = self.pending
        if worker.version < request["version"]:
            return False
        share = GEN.split(request["prompts"], self.slot)
        part = worker.generate(share, step=request["seed"], greedy=request["greedy"])
        if self.slot.collects:
            self.link.put_reply(n, worker.dp_rank, (self.slot, part))
        self.next_request, self.pending = n + 1, None
        return True


def rollout_runner(
    cfg, data, plan, store, *, pool, local: int, num_train: int, device: str
) -> RolloutPoolRunner:
    """Rollout pool rank `local`'s loop: its side of the weight bridge (collective with the
    actor's ranks), the link, the worker. Both backends (a Ray rollout rank actor runs it too)."""
    from rl3d.controller.assemble import PromptBatches
    from rl3d.data.tokenizer import pad_id_of
    from rl3d.weight_sync import WeightBridge
    from rl3d.workers.rollout_worker import RolloutWorker

    ro = cfg.rollout.async_
    bridge = WeightBridge(
        store,
        rank=num_train + local,
        num_train=num_train,
        num_rollout=pool.size,
        device=device,
        timeout_s=ro.timeout_s,
    )
    link = AsyncLink(store, timeout_s=ro.timeout_s, who=f"rollout pool rank {local}")
    worker = RolloutWorker(
        cfg,
        data.spec,
        pad_token_id=pad_id_of(data.tokenizer),
        tokenizer=data.tokenizer,
        pool_rank=local,
        bridge=bridge,
        plan=plan,
        link=link,
        device=device,
    )
    logger.info("rollout pool rank %d: %s", local, plan.describe())
    return RolloutPoolRunner(cfg, worker, PromptBatches(data.sampler), link, pool.offset + local)
