"""Sequence parallelism in rl3d's megatron models (`<role>.parallel.sequence_parallel`).

With megatron's `sequence_parallel`, the hidden states between the tensor-parallel blocks (the
norms, the residual stream, a mixture of experts' router) are split along the sequence over the
TP ranks: of a forward's S positions (megatron's [S, B, H]), TP rank r holds r S/t .. (r+1) S/t - 1
of every sample. The attention and MLP blocks all-gather them on entry and reduce-scatter on exit
(instead of one all-reduce), so activations outside those blocks cost 1/t. megatron-core's MoE
layer trains at TP > 1 only this way: its token dispatcher gathers the routed tokens of the TP
ranks itself.

What rl3d does around it:

- `resolve_sequence_parallel`: `auto` (the default) turns it on for a mixture of experts at
  TP > 1 and leaves dense models as they were; `true` for any model at TP > 1; `false` never.
- `padded_length`: a forward's sequence length is padded to a multiple of t (the micro-batching
  pads padded micro-batches on the left and packed rows at the end; `rl3d.engine.micro_batches`).
- `RMSNorm`: the local layer spec (no Transformer Engine)'s norm, whose torch module megatron refuses under
  sequence parallelism; its weight is marked `sequence_parallel`, so megatron's
  `finalize_model_grads` sums its gradient over TP (each rank saw only its positions).
- `token_shard` / `gather_tokens`: which of a forward's tokens (megatron's order, sequence-major)
  a TP rank's router sees, and the TP ranks' pieces put back together (routing replay and record).
- `gather_sequence`: the whole sequence of a TP rank's hidden states, for an output layer that
  reads only some positions or a value head replicated over TP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


def resolve_sequence_parallel(setting: bool | str, *, is_moe: bool, tp: int) -> bool:
    """Whether a model runs with sequence parallelism (`setting`: "auto", True or False):
    never at tp 1 (nothing to split)."""
    assert setting in ("auto", True, False), setting
    if tp == 1 or setting is False:
        return False
    return setting is True or is_moe


def padded_length(length: int, tp: int) -> int:
    """The smallest multiple of `tp` that holds `length` positions."""
    return -(-length // tp) * tp


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built like megatron's `WrappedTorchNorm`, allowed under sequence
    parallelism: the weight carries `sequence_parallel`, which `finalize_model_grads` reads to
    sum its gradient over the TP ranks."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        assert config.normalization == "RMSNorm", config.normalization
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def swap_module(spec: Any, old: type, new: type) -> Any:
    """A copy of a megatron layer spec (nested ModuleSpec / submodule dataclasses) with every
    use of module class `old` replaced by `new`."""
    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = [f.name for f in dataclasses.fields(spec) if f.init]
        changes = {name: swap_module(getattr(spec, name), old, new) for name in fields}
        return dataclasses.replace(spec, **changes)
    return spec


def token_shard(num_tokens: int, tp_rank: int, tp: int) -> slice:
    """The rows of a forward's [N, ...] token list (sequence-major: padded micro-batches put
    token t of sample b at row t B + b, a packed row is one sample) that TP rank `tp_rank`'s
    router sees: a contiguous 1/tp of them."""
    assert num_tokens % tp == 0, (num_tokens, tp)
    size = num_tokens // tp
    return slice(tp_rank * size, (tp_rank + 1) * size)


def gather_tokens(shard_N: torch.Tensor, tp_group: Any, tp: int) -> torch.Tensor:
    """The TP ranks' `token_shard`s of a token list concatenated in rank order (no gradient)."""
    if tp == 1:
        return shard_N
    out = shard_N.new_empty((shard_N.shape[0] * tp, *shard_N.shape[1:]))
    dist.all_gather_into_tensor(out, shard_N.contiguous(), group=tp_group)
    return out


def gather_sequence(hidden_SBH: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """A TP rank's [S/t, B, H] hidden states -> the whole [S, B, H], identical on every TP rank.

    The backward keeps this rank's part of the incoming gradient: whatever reads the gathered
    states must hand every TP rank the whole gradient (a replicated head computing the same
    loss on each rank; megatron's ColumnParallelLinear with `sequence_parallel` off all-reduces
    its input gradient over TP)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False, group=tp_group)
