"""The memory plan under sequence parallelism: which roles' micro-batches it applies to (the
role section's `parallel.sequence_parallel`, `auto` = a mixture of experts at tp > 1), their
length padded to a multiple of tp, and the hidden states between the blocks counted at s / tp."""

from pathlib import Path

from rl3d.config import load_config
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.models.spec import get_model_spec, spec_of
from rl3d.parallel import ParallelLayout
from rl3d.planning.memory_activations import activation_bytes, layer_bytes
from rl3d.planning.memory_roles import role_footprint, role_model

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"  # tiny Llama at tp 2
MOE = ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2}", "launch.nproc_per_node=4"]


def _shape(overrides, layout, is_moe):
    cfg = load_config(GRPO, ["data.max_prompt_length=15", *overrides]).config
    spec = spec_of(cfg.model)
    assert spec.is_moe == is_moe
    return role_footprint(cfg, spec, role_model(cfg, "actor"), layout, 0).batch


def test_which_micro_batches_split_their_sequence():
    moe = _shape(MOE, ParallelLayout(1, 2, 2, ep=2), is_moe=True)
    assert moe.sequence_parallel and moe.seq_len == 24  # 15 + 8, padded to a multiple of 2
    dense = _shape([], ParallelLayout(1, 2, 1), is_moe=False)
    assert not dense.sequence_parallel and dense.seq_len == 23  # as before
    asked = _shape(["actor.parallel.sequence_parallel=true"], ParallelLayout(1, 2, 1), is_moe=False)
    assert asked.sequence_parallel and asked.seq_len == 24
    packed = _shape(
        ["actor.parallel.sequence_parallel=true", "actor.packing=true"], ParallelLayout(1, 2, 1), False
    )
    assert packed.sequence_parallel and packed.seq_len % 2 == 0 and packed.rows == 1


def test_only_the_hidden_states_between_the_blocks_are_divided():
    spec = get_model_spec("tiny-llama")
    s, b, h, B, tp = 24, 8, spec.hidden_size, 4, 2
    plain = MicroBatchShape(s, b, 8, flash=False)
    split = MicroBatchShape(s, b, 8, flash=False, sequence_parallel=True)
    # two norms a layer, each its input, its output and the next linear's input
    assert layer_bytes(spec, tp, plain, B) - layer_bytes(spec, tp, split, B) == 6 * h * (s - s // tp) * b * B
    kw = dict(
        role="actor",
        tp=tp,
        layers=spec.num_layers,
        last_stage=True,
        lm_head=True,
        dtype_bytes=B,
        trains=False,
    )
    head = activation_bytes(spec, shape=plain, **kw) - activation_bytes(spec, shape=split, **kw)
    assert (
        head == layer_bytes(spec, tp, plain, B) - layer_bytes(spec, tp, split, B) + h * (s - s // tp) * b * B
    )
    assert layer_bytes(spec, 1, split, B) == layer_bytes(spec, 1, plain, B)  # tp 1: nothing to split
