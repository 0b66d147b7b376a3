"""A mixture of experts' dense first layers (GLM-4.5's and DeepSeek-V3's `first_k_dense_replace`)
keep a dense MLP's activations in the plan, not the experts'; the stage that holds them is the
first."""

from dataclasses import replace

from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.models.spec import get_model_spec
from rl3d.planning.memory_activations import activation_bytes, layer_bytes

SHAPE = MicroBatchShape(1024, 1, 512, True)


def _stage(spec, *, first_layer: int, layers: int) -> int:
    return activation_bytes(
        spec, role="actor", tp=1, layers=layers, first_layer=first_layer, last_stage=False, lm_head=True,
        shape=SHAPE, dtype_bytes=2, trains=True,
    )  # fmt: skip


def test_a_dense_first_layer_is_planned_as_dense():
    spec = get_model_spec("glm-4.5-air")  # 46 layers, the first dense
    dense, moe = layer_bytes(spec, 1, SHAPE, 2, layer=0), layer_bytes(spec, 1, SHAPE, 2, layer=1)
    assert dense != moe and layer_bytes(spec, 1, SHAPE, 2) == moe  # no index: an experts' layer
    # the same layer of the model without experts: its dense MLP, no routing
    assert dense == layer_bytes(replace(spec, num_experts=0, moe_first_dense_layers=0), 1, SHAPE, 2)
    whole = _stage(spec, first_layer=0, layers=46)
    assert whole == 45 * moe + dense + max(dense, moe)  # kept for the backward, plus its transient
    # two stages of 23: the first holds the dense layer, the second only experts' layers
    assert _stage(spec, first_layer=0, layers=23) == 22 * moe + dense + max(dense, moe)
    assert _stage(spec, first_layer=23, layers=23) == 24 * moe
