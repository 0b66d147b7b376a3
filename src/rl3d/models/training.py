"""Parallel training around a GPTModel: megatron DDP, optimizer, scheduler, PP schedule.

    ddp = wrap_ddp(model, groups, use_distributed_optimizer=optim.distributed_optimizer)
    optimizer = build_optimizer(ddp, groups, optim)     # optim: a role's rl3d.config.OptimConfig
    scheduler = build_scheduler(optimizer, optim, total_steps=100)
    outputs, grad_norm = train_step(ddp, optimizer, groups, forward_step, batches, ...)

`wrap_ddp` sets `config.finalize_model_grads_func`: megatron's schedules call it to all-reduce
(or reduce-scatter) the DP gradients and the tied-embedding gradients, and without it DP
gradients are silently not reduced. All collectives use the groups of `MegatronGroups`.

`forward_step(batch, model) -> (output_tensor, loss_func)` follows megatron's convention, except
that it receives one batch instead of an iterator (see `forward_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rl3d.models.bootstrap import MegatronGroups

MIN_LR = 0.0  # where a decaying schedule ends


def wrap_ddp(
    model: Any,
    groups: MegatronGroups,
    *,
    use_distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
) -> Any:
    """megatron DistributedDataParallel over `groups`, with the grad-finalize hook installed.
    `overlap_grad_reduce`: reduce each bucket of gradients while the backward runs (CUDA;
    `rl3d.models.fusions`); the schedules' `no_sync_func` keeps it to the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(
        config=model.config, ddp_config=ddp_config, module=model, pg_collection=groups.pg_collection
    )
    # Without this hook the schedules never reduce DP (or tied-embedding) gradients.
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    return ddp


def build_optimizer(ddp: Any, groups: MegatronGroups, cfg: Any) -> Any:
    """megatron's optimizer (distributed or not) over one DDP-wrapped model chunk; `cfg` is the
    role's `rl3d.config.OptimConfig` (read, not imported: the config layer sits above models)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    assert ddp.ddp_config.use_distributed_optimizer == cfg.distributed_optimizer, (
        "wrap_ddp and the optimizer disagree on use_distributed_optimizer"
    )
    dtype = ddp.config.params_dtype
    trained = [p for p in ddp.parameters() if p.requires_grad]
    if trained and all(p.dtype == torch.float32 for p in trained):
        # fp32 LoRA adapters over a 16-bit frozen base: they are their own masters, and megatron's
        # 16-bit optimizer can neither checkpoint fp32 parameters nor needs a copy of them
        dtype = torch.float32
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=MIN_LR,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    # megatron refuses its extra gloo groups together with explicit groups; they only serve the
    # legacy (non dist-checkpointing) distributed-optimizer save path.
    optimizer = get_megatron_optimizer(
        config, [ddp], use_gloo_process_groups=False, pg_collection=groups.pg_collection
    )
    ddp.config.grad_scale_func = optimizer.scale_loss
    make_optimizer_state(optimizer)
    return optimizer


def make_optimizer_state(optimizer: Any) -> None:
    """Adam's state for every master parameter now, not at the first step: torch's Adam makes
    `exp_avg` and `exp_avg_sq` lazily, so a role's memory would jump by 8 bytes a parameter in
    the middle of its first update, after a rollout engine sized its memory from what was free
    (SGLang measures at launch). Made by megatron's own `init_state_fn` (what it calls before
    loading an optimizer checkpoint), plus the step counter torch's Adam keeps per parameter,
    so the first step is the lazy one's bit for bit (`benchmarks/optimizer_state_jump.py`)."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "init_state_fn", None) is None:
            continue  # no parameters on this rank, or an optimizer without state (SGD)
        opt.init_state_fn(inner, opt.config)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for state in inner.state.values():  # fused Adams keep the step per group instead
                state.setdefault("step", torch.tensor(0.0))


def build_scheduler(optimizer: Any, cfg: Any, *, total_steps: int) -> Any:
    """megatron's OptimizerParamScheduler over `total_steps` optimizer steps, stepped once per
    step: `cfg.lr_warmup_steps` of linear warmup, then `cfg.lr_schedule` down to `MIN_LR`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr if cfg.lr_warmup_steps == 0 else 0.0,
        max_lr=cfg.lr,
        min_lr=MIN_LR,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(total_steps, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


def forward_backward(
    model: Any,
    groups: MegatronGroups,
    forward_step: Callable[[Any, Any], tuple[torch.Tensor, Callable]],
    microbatches: Iterable[Any],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[Any]:
    """Run megatron's (pipelined) schedule; the loss_func outputs, on the last PP stage only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    unwrapped = unwrap_model(model)
    schedule = get_forward_backward_func(pp_size=groups.layout.p, vp_size=None)
    p2p = P2PCommunicator(pp_group=groups.pp_group, config=unwrapped.config)
    iterator = iter(microbatches)

    def step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Callable]:
        return forward_step(next(data_iterator), chunk)

    if getattr(unwrapped.config, "num_moe_experts", None):
        # megatron keeps the aux-loss scale in a class attribute, shared by every model in the
        # process, and copies each schedule's scale into it in place: a role with an optimizer
        # (a 0-d scale) then a forward-only role (shape [1]) would clash; each schedule sets it anew
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None
    kwargs: dict[str, Any] = dict(pg_collection=groups.pg_collection)
    if groups.layout.p > 1:
        kwargs["p2p_communicator"] = p2p
    return schedule(
        forward_step_func=step,
        data_iterator=iterator,
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )


class SkippedSteps:
    """Optimizer steps skipped for inf/nan gradients, and the streak that ends a run.

    fp16's dynamic loss scaler starts at 2^32 and halves it on every overflow, so its first
    steps are skipped by design; in fp32/bf16 there is no scaler and one skipped step is an
    error. A streak of `max_in_a_row` fails."""

    def __init__(self, max_in_a_row: int = 1):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0

    def record(self, ok: bool) -> None:
        if ok:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer step(s) in a row skipped (inf/nan gradients; "
                f"{self.total} skipped in all)"
            )


def train_step(
    ddp: Any,
    optimizer: Any,
    groups: MegatronGroups,
    forward_step: Callable[[Any, Any], tuple[torch.Tensor, Callable]],
    microbatches: Iterable[Any],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    scheduler: Any = None,
    skipped: SkippedSteps | None = None,
) -> tuple[list[Any], float | None]:
    """One optimizer step over `num_microbatches` microbatches; (loss_func outputs, grad norm).
    A step the optimizer skips is counted in `skipped` (default: one is an error) and leaves the
    scheduler where it was, as megatron's own training loop does."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = forward_backward(
        ddp,
        groups,
        forward_step,
        microbatches,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
    )
    ok, grad_norm, _ = optimizer.step()
    (skipped or SkippedSteps()).record(ok)
    if ok and scheduler is not None:
        scheduler.step(increment=1)
    return outputs, grad_norm


def unwrap_model(model: Any) -> Any:
    """The model inside megatron's wrappers (DistributedDataParallel, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model
