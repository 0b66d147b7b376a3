"""Where generation runs and how far it may run ahead: `rollout.placement`, `rollout.pool`,
`rollout.async`.

- `placement: colocated` (default): the actor's ranks generate, the 3D-HybridEngine reshards
  in place between training and generation (the synchronous loop).
- `placement: separate`: generation runs on its own resource pool of `rollout.pool.tp *
  rollout.pool.dp` ranks (the world ranks after every other pool), holding a torch rollout
  engine in its own generation layout (t_g = `pool.tp`, `pool.dp` generation-DP ranks). After
  each update the training ranks send the actor's weights there (`rl3d.weight_sync`).
- `async.max_staleness` (separate only): how many policy versions a token may lag behind the
  policy that trains on it. 0 is synchronous (the rollout pool waits for the newest weights);
  1 lets the pool generate step k+1's samples while the trainer updates on step k's.
- `async.partial_rollouts`: a generation still running when new weights arrive continues with
  them (swapped between decode steps; each token records the version that produced it),
  instead of finishing on the old ones.

- failure containment (separate only, on with `rollout.timeout_s`): the pool generates its
  share prompt by prompt (a prompt's `n` samples together), each with a deadline of
  `rollout.timeout_s`; a sample that raises or runs past it is re-issued once
  (`rollout.reissue`) or dropped, and the step trains on what arrived when at least
  `rollout.min_fraction` of its prompts did. An engine that raises is rebuilt from the last
  weights it received, at most `rollout.max_restarts` times per rank.
- stragglers (separate only, on with `rollout.async.oversample` > 1, `rl3d.workers.oversample`):
  each rank keeps `oversample` times the prompt groups a step needs in flight, trains on the
  first that complete and carries the rest to the next step; carried samples older than
  `rollout.async.drop_staleness` are dropped instead of trained on.

YAML spells the section `async` (a Python keyword: the field is `async_`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rl3d.config.errors import FieldError

Placement = Literal["colocated", "separate"]
WeightUpdate = Literal["full", "delta"]
ROLLOUT_POOL = "rollout"  # the name of the separate generation pool
ENGINE_ROWS = 256  # TorchRolloutEngine's max_batch_rows: an over-sampling call is one batch


@dataclass(frozen=True, kw_only=True)
class RolloutPoolConfig:
    """The separate rollout pool's generation layout: `tp` ranks per engine (generation TP),
    `dp` engines, each generating its share of a step's prompts."""

    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True, kw_only=True)
class AsyncRolloutConfig:
    max_staleness: int = 0  # policy versions a token may lag behind (0 = synchronous)
    partial_rollouts: bool = True  # swap in new weights mid-generation
    bucket_mb: float = 64.0  # weight-sync bucket size (one send per bucket and rollout rank)
    timeout_s: float = 600.0  # a pool waiting longer than this for the other ends the job
    # stragglers (rl3d.workers.oversample): prompt groups in flight per group a step needs (1: off),
    # and how stale a sample may be before it is dropped instead of trained on (None: max_staleness + 1)
    oversample: float = 1.0
    drop_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise FieldError("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.oversample < 1:
            raise FieldError("oversample", f"must be >= 1 (1 = off), got {self.oversample}")
        if self.drop_staleness is not None and self.drop_staleness < self.max_staleness:
            raise FieldError(
                "drop_staleness",
                f"= {self.drop_staleness} must be >= max_staleness = {self.max_staleness} (the pool "
                "generates up to max_staleness versions ahead)",
            )
        for name in ("bucket_mb", "timeout_s"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")


def oversamples(cfg: Any) -> bool:
    """Whether a separate pool over-samples its steps (`rollout.async.oversample` > 1)."""
    return is_separate(cfg) and cfg.rollout.async_.oversample > 1


def staleness_bound(cfg: Any) -> int:
    """The most policy versions a trained token may lag: `max_staleness`, or with over-sampling
    `drop_staleness` (carried samples past it are dropped before they reach the trainer)."""
    ro = cfg.rollout.async_
    if not oversamples(cfg):
        return ro.max_staleness
    return ro.max_staleness + 1 if ro.drop_staleness is None else ro.drop_staleness


def _check_oversample(cfg: Any, fail: Callable[[str, str], Exception]) -> None:
    ro, key = cfg.rollout, "rollout.async.oversample"
    factor = ro.async_.oversample
    if factor == 1:
        if ro.async_.drop_staleness is not None:
            raise fail(
                "rollout.async.drop_staleness", "is for over-sampling: set rollout.async.oversample > 1"
            )
        return
    refusals = [
        (not is_separate(cfg), "needs rollout.placement: separate (stragglers are carried on the pool)"),
        (ro.agent.enabled, "runs single-turn rollouts (rollout.agent is set)"),
        (cfg.algorithm.dynamic_sampling, "and algorithm.dynamic_sampling are not combined (the pool "
         "draws its own prompts ahead)"),
        (ro.timeout_s is not None, "and failure containment (rollout.timeout_s) are not combined yet"),
        (ro.pool.tp > 1, f"runs on one-rank engines (rollout.pool.tp 1), got pool.tp {ro.pool.tp}"),
        (cfg.algorithm.routing_replay == "rollout", "keeps no routing record (algorithm.routing_replay)"),
        (cfg.algorithm.rollout_correction.mode == "none", "needs algorithm.rollout_correction (carried "
         "samples are off-policy; their per-token rollout log-probs are corrected for)"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise fail(key, f"= {factor} {why}")
    share = -(-cfg.data.prompts_per_step // ro.pool.dp)
    rows = int(share * factor + 0.999999) * ro.n
    if rows > ENGINE_ROWS:
        raise fail(
            key, f"= {factor}: {rows} samples in flight per rollout rank, over the engine's {ENGINE_ROWS}"
        )


def contains_failures(cfg: Any) -> bool:
    """Whether a separate pool contains its samples' failures (`rollout.timeout_s` set)."""
    return is_separate(cfg) and cfg.rollout.timeout_s is not None


def _check_containment(cfg: Any, fail: Callable[[str, str], Exception]) -> None:
    ro = cfg.rollout
    asked = [
        (key, value)
        for key, value, default in [
            ("rollout.timeout_s", ro.timeout_s, None),
            ("rollout.min_fraction", ro.min_fraction, 1.0),
            ("rollout.max_restarts", ro.max_restarts, 0),
        ]
        if value != default
    ]
    if not asked:
        return
    if not is_separate(cfg):
        key, value = asked[0]
        raise fail(
            key,
            f"= {value} needs rollout.placement: separate (a colocated engine does not contain failures yet)",
        )
    if ro.timeout_s is None:
        key, value = asked[0]
        raise fail(
            key,
            f"= {value} needs rollout.timeout_s (failures are contained per sample, each with a deadline)",
        )
    if ro.pool.tp > 1:
        raise fail(
            "rollout.pool.tp",
            f"= {ro.pool.tp}: failure containment (rollout.timeout_s) runs on one-rank engines (pool.tp 1)",
        )


def is_separate(cfg: Any) -> bool:  # cfg: rl3d.config.RL3DConfig (schema imports this module)
    return cfg.rollout.placement == "separate"


def check_async_rollout(cfg: Any, fail: Callable[[str, str], Exception]) -> None:
    """Cross-section checks (before any process group starts); `fail(key, message)`."""
    ro = cfg.rollout
    _check_containment(cfg, fail)
    _check_oversample(cfg, fail)
    if not is_separate(cfg):
        if ro.weight_update != "full":
            raise fail(
                "rollout.weight_update",
                f"= {ro.weight_update} needs rollout.placement: separate (a colocated rollout "
                "reshards the weights in place, nothing is sent)",
            )
        if ro.async_.max_staleness > 0:
            raise fail(
                "rollout.async.max_staleness",
                f"= {ro.async_.max_staleness} needs rollout.placement: separate (a colocated "
                "rollout shares the trainer's ranks, so it cannot run ahead)",
            )
        return
    if ro.engine != "torch":
        raise fail("rollout.engine", f"placement: separate runs the torch engine, got {ro.engine!r}")
    t, t_g = cfg.actor.parallel.tp, ro.pool.tp
    if t % t_g and t_g % t:
        raise fail("rollout.pool.tp", f"tp={t_g} must divide or be a multiple of actor.parallel.tp={t}")
