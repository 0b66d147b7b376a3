"""Name -> object registries for the algorithm library.

A recipe's `algorithm:` block names its pieces (`adv_estimator: grpo`, `policy_loss: clip_higher`,
`kl_estimator: k3`, ...); the controller resolves each name here. Adding an algorithm is a
registry entry plus a recipe, never an `if name == ...` in the controller.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to objects of one kind, filled by the `register` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register `obj` under `name`; used bare (`register(name, obj)`) or as a decorator."""

        def add(entry: T) -> T:
            assert name not in self._entries, f"{self.kind} {name!r} registered twice"
            self._entries[name] = entry
            return entry

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        known = self.names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; known: {', '.join(known)}")

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class AlgorithmFamily:
    """What the controller must provide for an advantage estimator.

    The controller reads this to decide which workers to build and what to generate:
    `needs_critic` builds a value model; `needs_cost_critic` a second one for costs (Safe-RLHF);
    `needs_group_samples` requires `n > 1` responses per prompt and `group_ids_B`;
    `needs_greedy_baseline` asks the rollout for one extra greedy response per prompt (ReMax);
    `supports_process_group` means the estimator whitens and accepts a DP `group` for it;
    `hooks` names the algorithm hooks the step needs for it (`rl3d.algos.algorithm`);
    `default_kl_placement` is where the reference-KL penalty usually goes for this family:
    `"reward"` (token-level penalty folded into rewards, PPO) or `"loss"` (GRPO).
    """

    name: str
    fn: Callable[..., object]
    needs_critic: bool
    needs_group_samples: bool = False
    needs_greedy_baseline: bool = False
    needs_cost_critic: bool = False
    supports_process_group: bool = False
    default_kl_placement: str = "reward"
    hooks: tuple[str, ...] = ()  # `rl3d.algos.algorithm.HOOKS` this estimator needs

    def __post_init__(self) -> None:
        assert self.default_kl_placement in ("reward", "loss"), self.default_kl_placement


ADVANTAGE_ESTIMATORS: Registry[AlgorithmFamily] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., object]] = Registry("policy loss")
LOSS_AGG_MODES: Registry[Callable[..., object]] = Registry("loss aggregation mode")
KL_ESTIMATORS: Registry[Callable[..., object]] = Registry("KL estimator")
KL_CONTROLLERS: Registry[Callable[..., object]] = Registry("KL controller")


def register_advantage_estimator(name: str, **family: object) -> Callable[[T], T]:
    """Decorator: register an estimator function together with its `AlgorithmFamily` flags."""

    def add(fn: T) -> T:
        ADVANTAGE_ESTIMATORS.register(name, AlgorithmFamily(name=name, fn=fn, **family))
        return fn

    return add


def get_advantage_estimator(name: str) -> AlgorithmFamily:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., object]:
    return POLICY_LOSSES.get(name)


def get_loss_agg_mode(name: str) -> Callable[..., object]:
    return LOSS_AGG_MODES.get(name)


def get_kl_estimator(name: str) -> Callable[..., object]:
    return KL_ESTIMATORS.get(name)


def get_kl_controller(name: str) -> Callable[..., object]:
    return KL_CONTROLLERS.get(name)
