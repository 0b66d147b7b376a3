"""The static bytes of a LoRA actor (`actor.lora`): the frozen base in `model.dtype` with no
gradient, master copy or Adam state; the fp32 adapters with their gradient buffer and Adam
states (their own master copy), sharded over TP the way `rl3d.models.lora` splits them."""

from __future__ import annotations

from rl3d.models.lora_names import FUSED, TARGETS
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import padded_vocab_size
from rl3d.planning.memory_train import ADAM_STATES, FP32, RoleBytes, ddp_buffer_numel


def adapter_numels(spec: ModelSpec, targets: tuple[str, ...], rank: int, *, tp: int, pp: int) -> list[int]:
    """Elements of each adapter factor on one rank of a PP stage (every stage holds as many)."""
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    h, f = spec.hidden_size, spec.ffn_hidden_size
    out_in = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}  # fmt: skip
    per_layer = []
    for fused in FUSED.values():
        for name in fused:
            if name not in targets:
                continue
            out, in_ = out_in[name]
            if TARGETS[name].row_parallel:  # A split by input columns, B whole
                per_layer += [rank * in_ // tp, out * rank]
            else:  # A whole, B split by output rows
                per_layer += [rank * in_, out // tp * rank]
    return per_layer * (spec.num_layers // pp)


def lm_head_numels(spec: ModelSpec, rank: int, *, tp: int) -> list[int]:
    """Elements of the output layer's adapter factors on one last-stage rank: A whole, B's rows
    split like megatron's padded vocabulary."""
    return [rank * spec.hidden_size, padded_vocab_size(spec.vocab_size, tp) // tp * rank]


def lora_static_bytes(
    base_numels: list[int],
    adapters: list[int],
    *,
    dtype_bytes: int,
    dp: int,
    distributed_optimizer: bool,
) -> RoleBytes:
    """A LoRA actor's parameters, gradient buffer and Adam states on one rank: megatron's DDP
    and optimizer see only the adapters (requires_grad), so the base sits outside its buffer."""
    buffer = ddp_buffer_numel(adapters, dp=dp, distributed_optimizer=distributed_optimizer)
    held = buffer if distributed_optimizer else sum(adapters)
    optimized = buffer // dp if distributed_optimizer else held
    return RoleBytes(
        params=sum(base_numels) * dtype_bytes + held * FP32,
        grads=buffer * FP32,
        master=0,  # fp32 adapters are their own master
        optimizer=ADAM_STATES * optimized * FP32,
    )
