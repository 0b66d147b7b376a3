"""Resharding strategies: each one plans a transition and then executes that same plan.

A strategy is a class with `plan(ctx) -> StrategyPlan` (pure Python over shapes, so `rl3d
plan` never imports torch) and `execute(plan, engine, train, zero_shards)`, which runs the
plan's collectives through the engine (`Resharder`) and assembles the generation weights.
Because execution walks the plan, the executor cannot move bytes the planner did not count.

The registry maps names to classes. This package registers only `hybridflow`, the strategy
training runs use; the baselines register themselves when `rl3d.hybrid_engine.baselines` is
imported (by `rl3d.bench`, and by the planner's models of the systems they stand for), so a
training run never carries them and nothing below the benchmark imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rl3d.hybrid_engine.registry import (  # noqa: F401  (re-exported)
    STRATEGIES,
    get_strategy,
    register_strategy,
)

if TYPE_CHECKING:
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.plan import PlanContext, StrategyPlan
    from rl3d.hybrid_engine.weights import GenerationWeights


class Strategy:
    name: ClassVar[str]
    # Ranks beyond the training world (separate rollout GPUs) take part in the transition.
    uses_rollout_ranks: ClassVar[bool] = False
    # Starts from the ZeRO-3 partition of the weights instead of the Megatron TP shards.
    needs_zero_shards: ClassVar[bool] = False
    # Runs its transfer as bucketed all-gathers that can start while the optimizer step goes on.
    overlaps_buckets: ClassVar[bool] = False
    # Plans a training layout with expert parallelism (each rank holding only its EP rank's experts).
    supports_ep: ClassVar[bool] = False

    def plan(self, ctx: PlanContext) -> StrategyPlan:
        raise NotImplementedError

    def execute(
        self, plan: StrategyPlan, engine: Resharder, train: dict, zero_shards: dict | None
    ) -> GenerationWeights | None:
        """This rank's generation weights, or None where the strategy leaves it without any."""
        raise NotImplementedError
