"""Where the rollout runs, chosen once: an object the one RL loop (`RLTrainer`) is handed.

A placement answers three questions of the loop:
- `first_round(prompts, step)`: this step's first round of samples;
- `generate(prompts, step=, greedy=)`: any other generation (an algorithm's extra round:
  DAPO's refill, ReMax's greedy baseline; validation);
- `publish(version)`: make policy `version` (after `version` updates) the one that generates.

`Colocated`: the actor's ranks generate; `publish` reshards the training weights in place
(the 3D-HybridEngine), the generation buffer is released after each step's rounds.

A placement also owns its side of the launch, before the loop exists (the `Placement`
protocol): which pools' ranks train (`trainer_pools`), what it starts on the backend through
the one interface every backend offers (`launch(host)`, `PoolHost`), and which role groups it
generates with (`bind`). `placement_of` chooses it, the one place colocated and separate are
told apart; the backends and the loop only ask it.

`SeparatePool` (`rollout.placement: separate`, see `rl3d.config.async_rollout`): the rollout
pool's ranks (`rl3d.controller.rollout_pool`) generate each step's first round ahead, as soon as
the newest policy they hold is at most `max_staleness` versions behind the one that will train
on it; every other generation is a request the pool answers with the newest policy sent (the
trainer waits for the answer, so none newer can come meanwhile): an extra round of step k with
version k - 1, validation after step k with version k, so at max_staleness 0 every generation is
the colocated loop's. With dynamic sampling a step takes a varying number of sampler batches, so
the pool starts step k + 1 at the trainer's sampler position after step k's rounds.

Old log-probs of stale samples are the current actor's (recomputed, or the update's own when
one update covers the step): PPO's trust region is around the policy being updated (decoupled
PPO, as AReaL); the behaviour policy, whose log-probs the engine recorded per token, enters only
through `algorithm.rollout_correction`. Checkpoints hold the trainer's position; samples in
flight are not saved: on resume the pool starts again from that position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rl3d.config.async_rollout import is_separate, staleness_bound
from rl3d.hybrid_engine.pool import publish_metrics
from rl3d.single_controller.async_link import AsyncLink, AsyncLinkError
from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import MODES, Dispatch

GEN = MODES[Dispatch.GENERATION_COMPUTE]


def round_seed(step: int, round_index: int) -> int:
    """The seed (`step` of `generate_sequences`) of round `round_index` of a training step."""
    return step * 16 + round_index


def round_uids(step: int, round_index: int, n: int) -> list[int]:
    """A unique id per prompt of a step's round: GRPO-style groups and DAPO's filter key on it."""
    return [step * 1_000_000 + round_index * 10_000 + i for i in range(n)]


def follows_trainer(cfg) -> bool:
    """Whether each step's prompts start where the trainer's previous step ended (dynamic
    sampling takes a varying number of rounds per step), not one sampler batch per step."""
    from rl3d.algos import Algorithm

    return Algorithm(cfg.algorithm).max_rounds > 1


@dataclass
class PoolConnection:
    """A controller's end of a separate rollout pool, as its backend started it."""

    link: AsyncLink
    send: Callable[[], Any]  # the actor's weights to the pool -> TransitionStats (checked against the plan)
    rank: int = 0  # this controller's rank (the Ray driver: 0)
    on_stop: Callable[[], None] = lambda: None  # after the pool acknowledged the stop


class PoolHost(Protocol):
    """What every backend offers a placement: starting a rollout pool of its own ranks."""

    def start_rollout_pool(self, pool: Any, plan: Any) -> PoolConnection | None:
        """Start `pool` (`rl3d.config.pools.Pool`) and the actor's side of the weight bridge
        (`plan`: the weight-sync plan); this controller's connection to it, or None in a
        process that became one of the pool's ranks (spmd: its loop is the backend's `runner`)."""
        ...


class Placement(Protocol):
    """Where generation runs. The launch's questions, then the loop's (the module docstring)."""

    def trainer_pools(self, pools: list) -> list:
        """The pools (`rl3d.config.pools.role_pools`) whose ranks train and run controllers."""
        ...

    def launch(self, host: PoolHost) -> None:
        """Start what this placement needs on the backend, before the role workers are built."""
        ...

    def bind(self, roles: Any) -> None:
        """The run's role groups (`rl3d.controller.trainer.RoleGroups`), once they exist."""
        ...

    def start(self, start_step: int, sampler_state: Callable[[], dict]) -> None: ...

    def stop(self, error: BaseException | None) -> None: ...

    def publish(self, version: int, *, needed: bool) -> dict[str, float]: ...

    def begin_step(self, step: int) -> None: ...

    def first_round(self, prompts: DataBatch, step: int) -> DataBatch: ...

    def generate(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch: ...

    def end_step(
        self, step: int, batch: DataBatch, sampler_state: Callable[[], dict]
    ) -> dict[str, float]: ...


def placement_of(cfg, spec: Any) -> Placement:
    """The run's placement (`rollout.placement`): the one place colocated and separate are
    told apart. `spec`: the model's `ModelSpec` (a separate pool's weight-sync plan needs it)."""
    if not is_separate(cfg):
        return Colocated()
    from rl3d.config.pools import weight_sync_plan

    plan = weight_sync_plan(cfg, spec)
    return SeparatePool(cfg, plan)


class Colocated:
    """The actor's ranks generate, on weights resharded in place from its training layout."""

    def __init__(self) -> None:
        self.actor: Any = None  # the actor's worker group (`bind`)

    def trainer_pools(self, pools: list) -> list:
        return pools

    def launch(self, host: PoolHost) -> None:
        pass  # the actor's own ranks generate: nothing to start

    def bind(self, roles: Any) -> None:
        self.actor = roles.actor

    def start(self, start_step: int, sampler_state: Callable[[], dict]) -> None:
        pass

    def stop(self, error: BaseException | None) -> None:
        pass

    def publish(self, version: int, *, needed: bool) -> dict[str, float]:
        return self.actor.call("reshard")  # every step: its reshard/* metrics are the step's

    def begin_step(self, step: int) -> None:
        pass

    def first_round(self, prompts: DataBatch, step: int) -> DataBatch:
        return self.generate(prompts, step=round_seed(step, 0))

    def generate(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch:
        return self.actor.call("generate_sequences", prompts, step=step, greedy=greedy)

    def end_step(self, step: int, batch: DataBatch, sampler_state: Callable[[], dict]) -> dict[str, float]:
        self.actor.call("release_generation")
        return {}


class SeparatePool:
    """The training ranks' side of a separate rollout pool (see the module docstring)."""

    def __init__(self, cfg, plan: Any):
        from rl3d.config.async_rollout import ROLLOUT_POOL
        from rl3d.config.pools import hosting, role_pools

        self.cfg, self.plan = cfg, plan  # plan: the weight-sync plan (`rl3d.hybrid_engine.pool`)
        self.pool = hosting(role_pools(cfg), ROLLOUT_POOL)
        self.rollout_ranks = list(self.pool.ranks)[:: cfg.rollout.pool.tp]  # each engine's collector
        self.max_staleness = staleness_bound(cfg)  # over-sampling: carried samples up to drop_staleness
        self.min_fraction = cfg.rollout.min_fraction  # of a step's prompts, with failure containment
        self.connection: PoolConnection | None = None  # `launch`
        self.published = -1  # the newest policy version sent to the pool
        self.phase = 0  # the step being trained or just trained (its validation)
        self.num_requests = 0  # requests are numbered alike on every training rank
        self.issued: list[tuple[int, int]] = []  # (phase, number) of requests not yet dropped
        self.waits: dict[str, float] = {}
        self.start_step = 0

    def trainer_pools(self, pools: list) -> list:
        return [p for p in pools if p.name != self.pool.name]  # the pool's ranks run its loop

    def launch(self, host: PoolHost) -> None:
        self.connection = host.start_rollout_pool(self.pool, self.plan)

    def bind(self, roles: Any) -> None:
        pass  # every generation is the pool's

    @property
    def link(self) -> AsyncLink:
        return self._connected().link

    @property
    def rank(self) -> int:
        return self._connected().rank

    def _connected(self) -> PoolConnection:
        if self.connection is None:
            raise RuntimeError("the rollout pool was not started: launch(host) comes before the loop")
        return self.connection

    def start(self, start_step: int, sampler_state: Callable[[], dict]) -> None:
        self.start_step = self.phase = start_step
        self.published = start_step - 1
        if self.rank == 0:
            self.link.put_start(start_step, sampler_state())

    def stop(self, error: BaseException | None) -> None:
        if error is not None:
            self.link.fail(f"training rank {self.rank} failed: {type(error).__name__}: {error}")
        if self.rank == 0:
            self.link.stop()
            self.link.wait_acks(self.cfg.rollout.pool.world_size, timeout_s=30.0)
        if error is None:
            self._connected().on_stop()

    def publish(self, version: int, *, needed: bool) -> dict[str, float]:
        """Send policy `version` to the pool, unless no step or validation is left to use it."""
        if not needed:
            return publish_metrics(self.plan, None)
        if self.rank == 0:
            self.link.announce_weights(version)
        stats = self._connected().send()  # returns once the pool took every bucket
        self.published = version
        return publish_metrics(self.plan, stats)

    def begin_step(self, step: int) -> None:
        """Drop what every training rank has read (parts, positions, requests two steps back)."""
        self.phase = step
        self.waits = {"async/wait_trainer_s": 0.0, "async/requests": 0.0}
        if self.rank == 0 and step - 2 > self.start_step:
            self.link.drop_parts(step - 2, len(self.rollout_ranks))
            self.link.drop_position(step - 2)
        for _, n in [r for r in self.issued if r[0] <= step - 2]:
            if self.rank == 0:
                self.link.drop_request(n, len(self.rollout_ranks))
        self.issued = [r for r in self.issued if r[0] > step - 2]

    def first_round(self, prompts: DataBatch, step: int) -> DataBatch:
        """The samples the pool generated ahead from its copy of the sampler, checked against
        the trainer's prompts."""
        start = time.perf_counter()
        parts = self.link.get_parts(step, len(self.rollout_ranks), self.rollout_ranks)
        self.waits["async/wait_trainer_s"] += time.perf_counter() - start
        batch = GEN.collect([(slot, out) for slot, out, _ in parts], "mean")
        got = sorted(set(batch["index"])) if batch is not None else []
        want = sorted(set(prompts["index"]))
        counts = [info.get("counts", {}) for *_, info in parts]
        self.waits |= {k: float(sum(c.get(k, 0) for c in counts)) for k in {k for c in counts for k in c}}
        oversampled = "rollout/in_flight" in self.waits  # the pool's own prompts, carried ones among them
        if (
            got != want
            and not oversampled
            and not (set(got) < set(want) and self.waits.get("rollout/dropped"))
        ):
            raise AsyncLinkError(
                f"step {step}: the rollout pool generated prompts {got}, the trainer expected {want}"
            )
        if len(got) < self.min_fraction * len(want) and not oversampled:
            raise AsyncLinkError(
                f"step {step}: {len(got)} of {len(want)} prompts' samples arrived from the rollout "
                f"pool ({self.waits.get('rollout/dropped', 0):.0f} dropped), under rollout.min_fraction "
                f"= {self.min_fraction}"
            )
        self.waits["async/wait_rollout_s"] = max(info["wait_rollout_s"] for *_, info in parts)
        self.waits["async/rollout_generate_s"] = max(info["generate_s"] for *_, info in parts)
        self.waits["async/rollout_generate_cpu_s"] = max(info["generate_cpu_s"] for *_, info in parts)
        for key in ("decode_steps", "decode_rows"):  # the engine's work (not with containment)
            if all(key in info for *_, info in parts):
                self.waits[f"async/rollout_{key}"] = float(max(info[key] for *_, info in parts))
        return batch

    def generate(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch:
        """A generation request to the pool, answered with policy version `self.published`."""
        from rl3d.workers.rollout_worker import POLICY_VERSION

        n, self.num_requests = self.num_requests, self.num_requests + 1
        self.issued.append((self.phase, n))
        request = {"prompts": prompts, "seed": step, "greedy": greedy, "version": self.published}
        if self.rank == 0:
            self.link.put_request(n, request)
        start = time.perf_counter()
        parts = self.link.get_replies(n, len(self.rollout_ranks), self.rollout_ranks)
        waits = self.waits  # a validation's requests count in no step's metrics
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

    def end_step(self, step: int, batch: DataBatch, sampler_state: Callable[[], dict]) -> dict[str, float]:
        """Post the sampler's position for the pool's next step; check and report staleness."""
        from rl3d.workers.rollout_worker import check_staleness, staleness_metrics

        if self.rank == 0 and follows_trainer(self.cfg) and step < self.cfg.trainer.total_steps:
            self.link.put_position(step + 1, sampler_state())
        check_staleness(batch, step, self.max_staleness)  # every round's samples
        return staleness_metrics(batch, step) | self.waits
