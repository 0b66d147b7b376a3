"""Bytes a megatron-core role holds on one rank while it trains: from shapes alone.

What megatron-core 0.16 allocates, as rl3d builds it (`rl3d.models.training`):
- parameters in `model.dtype`; with the distributed optimizer DDP moves them into one flat
  `param_data` buffer (`ParamAndGradBuffer`) whose end is padded to a multiple of
  lcm(dp, 128) elements and each parameter's start to 64 elements; without it no padding;
- one flat gradient buffer (`grad_data`) of the same padded length: fp32, since `wrap_ddp`
  sets `grad_reduce_in_fp32` (param.main_grad is a view of it; `.grad` stays None);
- an fp32 master copy only for bf16/fp16 parameters: `Float16OptimizerWithFloat16Params`
  clones every parameter to fp32; the distributed optimizer clones only this DP rank's shard
  (numel / dp of the padded buffer). fp32 parameters are their own master (no copy);
- Adam's exp_avg and exp_avg_sq, fp32, on the master parameters (so sharded by DP with the
  distributed optimizer), created at the first optimizer step;
- a frozen role (reference, reward model) holds its parameters only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from rl3d.models.params import ParamInfo, expert_owner, megatron_params, stages_of
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import ShardKind, padded_vocab_size

FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq
DIST_OPT_PARAM_ALIGN = 64  # elements: a parameter's start in the distributed optimizer's buffer
DIST_OPT_BUCKET_ALIGN = 128  # elements (times dp): the buffer's end


@dataclass(frozen=True)
class ByteItems:
    """Named byte counts (a subclass's fields); `total` is their sum."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def items(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> dict[str, int]:
        return {**self.items(), "total": self.total}


@dataclass(frozen=True)
class RoleBytes(ByteItems):
    """One role's bytes on one rank in one phase; `total` is their sum."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def static(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def dynamic(self) -> int:
        return self.activations + self.buffers


def local_numel(param: ParamInfo, tp: int) -> int:
    """Elements of `param` on one TP rank of `tp`. A QKV with more TP ranks than KV heads keeps
    one KV head per rank (generation engines replicate them; megatron refuses the layout)."""
    if param.kind is ShardKind.REPLICATED:
        return param.numel
    if param.kind is ShardKind.QKV:
        nq, ng, hd = param.heads
        per_row = param.numel // param.shape[0]
        return (nq // tp + 2 * max(ng // tp, 1)) * hd * per_row
    return param.numel // tp


@functools.lru_cache(maxsize=16)
def model_inventory(spec: ModelSpec, role: str, padded_vocab: int) -> tuple[ParamInfo, ...]:
    """`megatron_params`, kept: a search over layouts asks for the same model many times, and a
    large mixture of experts lists tens of thousands of expert weights."""
    return tuple(megatron_params(spec, role=role, padded_vocab=padded_vocab))


def stage_numels(
    spec: ModelSpec,
    role: str,
    *,
    tp: int,
    pp: int,
    pp_rank: int,
    ep: int = 1,
    experts: bool | None = None,
    etp: int | None = None,
) -> list[int]:
    """Elements of each parameter a rank of PP stage `pp_rank` holds, in megatron's order; a
    tied model's last stage (pp > 1) also holds the synced output copy of the embedding.

    With expert parallelism `ep` a rank holds E/ep of each layer's routed experts (every EP rank
    as many, of the same shapes). `experts` selects the routed experts' weights only (True),
    every other parameter only (False), or all (None). Each expert is split over `etp` ranks
    (None: tp), every other TP-sharded weight over `tp`."""
    vocab = padded_vocab_size(spec.vocab_size, tp)
    params = model_inventory(spec, role, vocab)
    out = [
        local_numel(p, tp if p.expert is None or etp is None else etp)
        for p in params
        if pp_rank in stages_of(p, spec.num_layers, pp)
        and (experts is None or experts == (p.expert is not None))
        and (p.expert is None or expert_owner(spec, p.expert, ep)[0] == 0)
    ]
    if experts is not True and spec.tied_embeddings and role != "critic" and pp > 1 and pp_rank == pp - 1:
        out.append(vocab * spec.hidden_size // tp)
    return out


def ddp_buffer_numel(numels: list[int], *, dp: int, distributed_optimizer: bool) -> int:
    """Length of megatron's flat param/grad buffer, as one bucket. With `overlap_grad_reduce`
    (on by default on CUDA, `rl3d.models.fusions`) DDP splits it into buckets of at least 40M
    parameters, each padded to the same divisor: at most lcm(dp, 128) elements more per bucket,
    which this leaves out (under 0.01% of a 7B role's buffer)."""
    if not distributed_optimizer:
        return sum(numels)
    end = 0
    for n in reversed(numels):  # megatron lays parameters out in reverse order
        end = math.ceil(end / DIST_OPT_PARAM_ALIGN) * DIST_OPT_PARAM_ALIGN + n
    divisor = math.lcm(dp, DIST_OPT_BUCKET_ALIGN)
    return math.ceil(end / divisor) * divisor


def layout_static_bytes(
    spec: ModelSpec,
    role: str,
    *,
    tp: int,
    pp: int,
    pp_rank: int,
    dp: int,
    ep: int,
    dtype_bytes: int,
    trainable: bool,
    distributed_optimizer: bool,
    etp: int | None = None,
) -> RoleBytes:
    """`static_bytes` of a rank of a p-t-d layout with expert parallelism `ep`. With ep > 1
    megatron marks the routed experts expert-parallel and gives them their own param/grad
    buffer, data-parallel over the d/ep ranks holding the same experts (its distributed
    optimizer shards their master and Adam states over those); at ep 1 they sit in the one
    buffer with the rest. With expert TP `etp` apart from tp, an expert is split over etp
    ranks and its shard held by t d / (ep etp) of them."""
    common = {
        "dtype_bytes": dtype_bytes,
        "trainable": trainable,
        "distributed_optimizer": distributed_optimizer,
    }
    where = {"tp": tp, "pp": pp, "pp_rank": pp_rank}
    if ep == 1 or not spec.is_moe:
        return static_bytes(stage_numels(spec, role, **where), dp=dp, **common)
    dense = static_bytes(stage_numels(spec, role, **where, ep=ep, experts=False), dp=dp, **common)
    expert_dp = dp // ep if etp is None else tp * dp // (ep * etp)
    numels = stage_numels(spec, role, **where, ep=ep, experts=True, etp=etp)
    experts = static_bytes(numels, dp=expert_dp, **common)
    return RoleBytes(**{k: v + experts.items()[k] for k, v in dense.items().items()})


def static_bytes(
    numels: list[int], *, dtype_bytes: int, trainable: bool, dp: int, distributed_optimizer: bool
) -> RoleBytes:
    """Parameters, gradient buffer, master copy and Adam states of one rank (see the module
    docstring for what megatron allocates)."""
    if not trainable:
        return RoleBytes(params=sum(numels) * dtype_bytes)
    buffer = ddp_buffer_numel(numels, dp=dp, distributed_optimizer=distributed_optimizer)
    held = buffer if distributed_optimizer else sum(numels)
    optimized = buffer // dp if distributed_optimizer else held  # what this rank's Adam updates
    return RoleBytes(
        params=held * dtype_bytes,
        grads=buffer * FP32,
        master=optimized * FP32 if dtype_bytes != FP32 else 0,
        optimizer=ADAM_STATES * optimized * FP32,
    )
