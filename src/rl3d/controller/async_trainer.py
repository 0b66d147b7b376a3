"""The RL loop with a separate rollout pool (`rollout.placement: separate`, see
`rl3d.config.async_rollout`).

Under torchrun the world splits into one world per pool (`split_world`); the rollout pool comes
last. Its ranks run `RolloutPoolRunner`: generate step k's samples as soon as the newest
policy they hold is at most `max_staleness` versions behind the one that will train on them
(version k - 1), and hand them over; meanwhile they take in every new version the trainer
sends. The other ranks run `AsyncTrainer`, the same `RLTrainer` loop whose generate stage
takes the finished samples instead of generating, and whose reshard stage sends the updated
weights to the rollout pool instead of resharding in place.

Every other generation of the loop is a request to the pool (`RLTrainer.rollout`): DAPO's
refill rounds, ReMax's greedy baseline and validation. The pool answers requests before
generating ahead, with the newest policy the trainer sent (the trainer waits for the answer, so
none newer can come meanwhile): an extra round of step k with version k - 1, validation after
step k with version k, so at max_staleness 0 every generation is the colocated loop's. With
dynamic sampling a step takes a varying number of sampler batches, so the pool starts step
k + 1 at the trainer's sampler position after step k's rounds (posted when they end).

Old log-probs of stale samples are the current actor's (as in the colocated loop: recomputed,
or the update's own detached log-probs when one update covers the step): PPO's trust region is
then around the policy being updated (decoupled PPO, as AReaL), and the behaviour policy,
whose log-probs the engine recorded per token (maybe over two versions with partial
rollouts), enters only through `algorithm.rollout_correction` (TIS: min(pi_old/pi_rollout, C)).
Recomputing also keeps pi_old one policy, where the engine's log-probs mix versions.

Checkpoints hold the trainer's position (the prompts of every step it trained on); samples in
flight are not saved. On resume the rollout pool starts again from that position, so the
prompts of a step that was in flight are generated again and trained on once: nothing lost,
nothing used twice (the trainer checks each step's prompts against its own sampler).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl3d.config import LoadedConfig
from rl3d.config.async_rollout import ROLLOUT_POOL
from rl3d.config.roles import ACTOR
from rl3d.controller.trainer import RLTrainer
from rl3d.single_controller.async_link import POLL_S, AsyncLink, AsyncLinkError
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import MODES, Dispatch, Slot

logger = logging.getLogger(__name__)
GEN = MODES[Dispatch.GENERATION_COMPUTE]


def step_uids(step: int, n: int) -> list[int]:
    return [step * 1_000_000 + i for i in range(n)]  # the colocated loop's, round 0


class AsyncTrainer(RLTrainer):
    """`RLTrainer` on the training ranks of a run with a separate rollout pool.

    Every generation is the rollout pool's: a step's first round is the one the pool made ahead
    (`put_part`); any other call (an algorithm's extra round: DAPO's refill, ReMax's greedy
    baseline; validation) is a request (`put_request`) the pool answers with the newest policy
    sent, which the trainer checks: with max_staleness 0 every round is generated exactly as
    the colocated loop would (same weights, seeds, prompts and uids)."""

    def __init__(
        self,
        *args: Any,
        link: AsyncLink,
        send: Callable[[], Any],
        rollout_ranks: list[int],  # the pool's rank that hands over each engine's samples
        sync_bytes: int,
        rank: int,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.link, self.send, self.rollout_ranks = link, send, rollout_ranks
        self.sync_bytes, self.rank = sync_bytes, rank
        self.max_staleness = self.cfg.rollout.async_.max_staleness
        self.published = self.start_step - 1  # the newest policy version sent to the pool
        self.phase = self.start_step  # the step being trained or just trained (its validation)
        self.num_requests = 0  # requests are numbered alike on every training rank
        self.issued: list[tuple[int, int]] = []  # (phase, number) of requests not yet dropped
        self.step_waits: dict[str, float] = {}

    def fit(self) -> list[dict[str, float]]:
        if self.rank == 0:
            self.link.put_start(self.start_step, self.sampler.sampler.state_dict())
        try:
            return super().fit()
        except BaseException as err:
            self.link.fail(f"training rank {self.rank} failed: {type(err).__name__}: {err}")
            raise
        finally:
            if self.rank == 0:
                self.link.stop()
                self.link.wait_acks(self.cfg.rollout.pool.world_size, timeout_s=30.0)

    def publish_weights(self, version: int) -> dict[str, float]:
        """Send policy `version` (after `version` updates) to the rollout pool, unless no step
        or validation is left to use it."""
        if version >= self.cfg.trainer.total_steps and not self.validation.due(version):
            return {"weight_sync/bytes": 0.0, "weight_sync/seconds": 0.0}
        if self.rank == 0:
            self.link.announce_weights(version)
        stats = self.send()  # returns once the pool took every bucket
        self.published = version
        return {"weight_sync/bytes": float(self.sync_bytes), "weight_sync/seconds": stats.seconds}

    def generate(self, step: int, metrics: dict[str, float]) -> DataBatch:
        from rl3d.workers.rollout_worker import check_staleness, staleness_metrics

        self.phase = step
        self.step_waits = {"async/wait_trainer_s": 0.0, "async/requests": 0.0}
        if self.rank == 0 and step - 2 > self.start_step:  # every training rank has read them
            self.link.drop_parts(step - 2, len(self.rollout_ranks))
            self.link.drop_position(step - 2)
        for _, n in [r for r in self.issued if r[0] <= step - 2]:
            if self.rank == 0:
                self.link.drop_request(n, len(self.rollout_ranks))
        self.issued = [r for r in self.issued if r[0] > step - 2]
        batch = super().generate(step, metrics)  # the first round, extra rounds, scoring
        if self.rank == 0 and follows_trainer(self.cfg) and step < self.cfg.trainer.total_steps:
            self.link.put_position(step + 1, self.sampler.sampler.state_dict())
        check_staleness(batch, step, self.max_staleness)  # every round's samples
        metrics |= staleness_metrics(batch, step) | self.step_waits
        return batch

    def rollout_round(self, prompts: DataBatch, step: int, round_index: int) -> DataBatch:
        """Round 0: the samples the pool generated ahead from its copy of the sampler, checked
        against the trainer's prompts. Later rounds (dynamic sampling): requests."""
        if round_index:
            return super().rollout_round(prompts, step, round_index)
        start = time.perf_counter()
        parts = self.link.get_parts(step, len(self.rollout_ranks), self.rollout_ranks)
        self.step_waits["async/wait_trainer_s"] += time.perf_counter() - start
        batch = GEN.collect([(slot, out) for slot, out, _ in parts], "mean")
        got, want = sorted(set(batch["index"])), sorted(set(prompts["index"]))
        if got != want:
            raise AsyncLinkError(
                f"step {step}: the rollout pool generated prompts {got}, the trainer expected {want}"
            )
        self.step_waits["async/wait_rollout_s"] = max(info["wait_rollout_s"] for *_, info in parts)
        self.step_waits["async/rollout_generate_s"] = max(info["generate_s"] for *_, info in parts)
        return batch

    def rollout(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch:
        """A generation request to the rollout pool, answered with policy version
        `self.published` (the newest sent; none newer can come while the trainer waits)."""
        from rl3d.workers.rollout_worker import POLICY_VERSION

        n, self.num_requests = self.num_requests, self.num_requests + 1
        self.issued.append((self.phase, n))
        request = {"prompts": prompts, "seed": step, "greedy": greedy, "version": self.published}
        if self.rank == 0:
            self.link.put_request(n, request)
        start = time.perf_counter()
        parts = self.link.get_replies(n, len(self.rollout_ranks), self.rollout_ranks)
        waits = self.step_waits  # a validation's requests count in no step's metrics
        waits["async/wait_trainer_s"] = waits.get("async/wait_trainer_s", 0.0) + time.perf_counter() - start
        waits["async/requests"] = waits.get("async/requests", 0.0) + 1
        batch = GEN.collect(parts, "mean")
        made = batch[POLICY_VERSION][batch["response_mask"].bool()]
        if made.numel() and (made != self.published).any():
            raise AsyncLinkError(
                f"generation request {n}: the rollout pool answered with policy versions "
                f"{sorted(set(made.tolist()))}, the trainer sent {self.published}"
            )
        return batch

    def end_rollout(self) -> None:
        pass  # the training ranks hold no generation weights


class RolloutPoolRunner:
    """The loop of a rollout-pool rank (its `fit` returns no metrics)."""

    def __init__(self, cfg, worker, sampler, link: AsyncLink, world_rank: int):
        self.cfg, self.worker, self.sampler, self.link = cfg, worker, sampler, link
        self.world_rank = world_rank

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
        prompts = self.sampler.next_batch()
        prompts.set("uid", step_uids(step, len(prompts)))
        began = time.perf_counter()
        part = self.worker.generate(GEN.split(prompts, self.slot), step=step * 16)
        info = {"wait_rollout_s": waited, "generate_s": time.perf_counter() - began}
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


def follows_trainer(cfg) -> bool:
    """Whether each step's prompts start where the trainer's previous step ended (dynamic
    sampling takes a varying number of rounds per step), not one sampler batch per step."""
    from rl3d.algos import Algorithm

    return Algorithm(cfg.algorithm).max_rounds > 1


def build_async(loaded: LoadedConfig, run_dir: Path, pools: list) -> Any:
    """This rank's side of a run with a separate rollout pool: `AsyncTrainer` on the training
    ranks, `RolloutPoolRunner` on the rollout pool's."""
    from rl3d.controller.assemble import assemble_trainer, build_data
    from rl3d.controller.build import SPMDBackend
    from rl3d.controller.rank import build_rank_workers
    from rl3d.models.bootstrap import init_megatron
    from rl3d.single_controller.spmd_pools import ControllerChannel, split_world
    from rl3d.weight_sync import WeightBridge, send_weights

    cfg = loaded.config
    pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.launch.timeout_s)
    store, world_rank = channel.store, channel.rank
    actor, rollout = pools[0], pools[-1]
    assert rollout.name == ROLLOUT_POOL, pools
    ro = cfg.rollout.async_
    data = build_data(cfg)
    plan = sync_plan(cfg, data.spec, actor)
    device = _device(cfg)
    if pool.name == ROLLOUT_POOL:
        local = world_rank - pool.offset
        return rollout_runner(
            cfg, data, plan, store, pool=pool, local=local, num_train=actor.size, device=device
        )
    bridge = None
    if pool.name == ACTOR:
        bridge = WeightBridge(
            store,
            rank=world_rank - pool.offset,
            num_train=actor.size,
            num_rollout=rollout.size,
            device=device,
            timeout_s=ro.timeout_s,
        )

    train_pools = pools[:-1]
    trainer_channel = None
    if len(train_pools) > 1:  # critic/reference pools too: the controller's channel without the rollout pool
        trainer_channel = ControllerChannel(
            dist.PrefixStore("trainer/", store), world_rank, rollout.offset, channel.timeout_s
        )
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    rank = build_rank_workers(
        cfg,
        data.spec,
        groups,
        data.tokenizer,
        pools=train_pools,
        pool=pool,
        run_dir=run_dir,
        sync=trainer_channel.barrier if trainer_channel else lambda: None,
    )
    actor_worker = rank.workers.get(ACTOR)

    def send():
        if actor_worker is None:  # a critic/reference rank: not part of the transfer
            return _NoSync
        return send_weights(bridge, plan, actor_worker.role.global_shards(), world_rank - actor.offset)

    link = AsyncLink(store, timeout_s=ro.timeout_s, who=f"training rank {world_rank}")
    backend = SPMDBackend(cfg, rank, data.tokenizer, trainer_channel)

    def make(*args, **kwargs):
        return AsyncTrainer(
            *args,
            link=link,
            send=send,
            rollout_ranks=list(rollout.ranks)[:: cfg.rollout.pool.tp],  # each engine's collector
            sync_bytes=plan.total_bytes,
            rank=world_rank,
            **kwargs,
        )

    logger.info("%s", plan.describe())
    return assemble_trainer(cfg, run_dir, backend, data, make=make)


def sync_plan(cfg, spec, actor) -> Any:
    """The weight-sync plan from the actor's pool to the rollout pool (pure: both backends)."""
    from rl3d.utils.dtypes import DTYPE_BYTES
    from rl3d.weight_sync import plan_weight_sync

    return plan_weight_sync(
        spec,
        actor.layout,
        gen_tp=cfg.rollout.pool.tp,
        gen_dp=cfg.rollout.pool.dp,
        bytes_per_element=DTYPE_BYTES[cfg.model.dtype],
        bucket_bytes=int(cfg.rollout.async_.bucket_mb * 2**20),
    )


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
        pool_rank=local,
        bridge=bridge,
        plan=plan,
        link=link,
        device=device,
    )
    logger.info("rollout pool rank %d: %s", local, plan.describe())
    return RolloutPoolRunner(cfg, worker, PromptBatches(data.sampler), link, pool.offset + local)


class _NoSync:
    seconds = 0.0


def _device(cfg) -> str:
    from rl3d.utils.device import resolve_device

    return resolve_device(cfg.launch.device)
