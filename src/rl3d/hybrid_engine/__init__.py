"""The 3D-HybridEngine: reshard the actor's weights from the training layout to the
generation layout (docs/hybrid_engine.md says how, with the benchmarks), in place or to a
separate rollout pool's ranks (`plan_pool_transition`, run over `rl3d.weight_sync`'s bridge);
for an engine that keeps its own copy as HF tensors (SGLang), the transition ends with the push
(`plan_engine_push`, run by `Resharder.push`).

`plan_transition` and the strategy registry are pure Python, so planning never imports torch;
the torch-side names (`Resharder`, `GenerationWeights`, ...) load on first use for the same
reason. Importing the package registers `hybridflow` only; the benchmark's baselines
(`baselines`) and hybridflow's per-node routing (`hierarchical`) register when their modules
are imported (`rl3d.bench` imports both).
"""

from rl3d.hybrid_engine import hybridflow as _hybridflow  # noqa: F401  registers "hybridflow"
from rl3d.hybrid_engine.engine_push import NO_PUSH, EnginePush, plan_engine_push
from rl3d.hybrid_engine.plan import StrategyPlan, TransitionPlan, plan_transition
from rl3d.hybrid_engine.pool import PoolTransition, plan_pool_transition
from rl3d.hybrid_engine.strategy import STRATEGIES, Strategy, get_strategy, register_strategy
from rl3d.utils.imports import lazy_attributes

_LAZY = {
    "Resharder": "rl3d.hybrid_engine.executor",
    "TransitionStats": "rl3d.hybrid_engine.executor",
    "GenerationWeights": "rl3d.hybrid_engine.weights",
    "ReshardError": "rl3d.hybrid_engine.comm",
}

__all__ = [
    "NO_PUSH",
    "STRATEGIES",
    "EnginePush",
    "PoolTransition",
    "Strategy",
    "StrategyPlan",
    "TransitionPlan",
    "get_strategy",
    "plan_engine_push",
    "plan_pool_transition",
    "plan_transition",
    "register_strategy",
    *_LAZY,
]

__getattr__ = lazy_attributes(__name__, _LAZY)
