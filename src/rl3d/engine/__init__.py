"""The engine that runs a megatron model of a role on its grid (`MegatronEngine`), between the
models and the hybrid engine below and the workers above: workers say which columns a role
computes and which loss it trains, the engine how. Model techniques are its features
(`rl3d.engine.features`, the table in `rl3d.engine.techniques`)."""

from rl3d.engine.features import Feature, Features, FeatureSource, Footprint
from rl3d.engine.megatron import METRIC_WEIGHT, InitialWeights, MegatronEngine, Training
from rl3d.engine.micro_batches import forward_micro_batch, last_token_outputs

__all__ = [
    "METRIC_WEIGHT",
    "Feature",
    "FeatureSource",
    "Features",
    "Footprint",
    "InitialWeights",
    "MegatronEngine",
    "Training",
    "forward_micro_batch",
    "last_token_outputs",
]
