"""Token log-probs and entropy from vocab-parallel logits, never gathering the full vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The forward pass
all-reduces a max, then one stacked sum of (sum exp, target logit, sum exp * logit); the
backward is analytic and needs no communication, like megatron's vocab-parallel cross entropy:

    d logp_t / d z_k = 1[k = t] - p_k
    d H / d z_k      = -p_k (log p_k + H)

Vocabulary rows past `vocab_size` (Megatron's padding) are masked out, so the result equals
`log_softmax` over the real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _tp_info(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


CHUNK_BYTES = 32 << 20  # each fp64 temporary of one chunk of rows


def _partial_sums(z: torch.Tensor, z_max: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
    """[3, rows]: sum exp(z - max), the target's logit (0 where another rank holds it) and
    sum exp(z - max) * z over this rank's vocabulary slice, in fp64."""
    vocab_local = z.shape[-1]
    exp = torch.exp(z - z_max.unsqueeze(-1))
    in_slice = (target >= start) & (target < start + vocab_local)
    local_index = (target - start).clamp(0, vocab_local - 1).unsqueeze(-1)
    target_z = torch.gather(z, -1, local_index).squeeze(-1)
    finite_z = torch.where(exp > 0, z, 0.0)  # 0 * -inf would be nan
    return torch.stack(
        [
            exp.sum(-1, dtype=torch.float64),
            torch.where(in_slice, target_z, torch.zeros_like(target_z)).double(),
            (exp.double() * finite_z.double()).sum(-1),
        ]
    )


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        rank, world = _tp_info(group)
        vocab_local = logits.shape[-1]
        start = rank * vocab_local
        z = logits.float()
        if vocab_size is not None and start + vocab_local > vocab_size:
            padded = torch.arange(start, start + vocab_local, device=z.device) >= vocab_size
            z = z.masked_fill(padded, float("-inf"))
        z_max = z.max(dim=-1).values
        if world > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        # Partial sums in fp64: rounding them to fp32 only at the end makes the result the same
        # for every TP size (a TP split reorders the vocabulary sum). The fp64 temporaries cover
        # a bounded number of rows at a time: at a 152k vocabulary a whole micro-batch's would be
        # tens of GB, and chunks of 32 MB reuse their pages instead of faulting fresh ones (SmolLM2's
        # 384 x 49152 logits: 150 MB each). Rows are independent, so chunking them changes no sum.
        z_rows, max_rows, target_rows = z.reshape(-1, vocab_local), z_max.reshape(-1), target.reshape(-1)
        step = max(1, CHUNK_BYTES // (8 * vocab_local))
        partials = torch.cat(
            [
                _partial_sums(z_rows[i : i + step], max_rows[i : i + step], target_rows[i : i + step], start)
                for i in range(0, z_rows.shape[0], step)
            ],
            dim=1,
        ).reshape(3, *z_max.shape)
        if world > 1:
            dist.all_reduce(partials, group=group)
        sum_exp, target_logit, sum_exp_z = partials
        log_z = (z_max.double() + torch.log(sum_exp)).float()
        logp = (target_logit - log_z.double()).float()
        entropy = (log_z.double() - sum_exp_z / sum_exp).float()
        ctx.save_for_backward(z, target, log_z, entropy)
        ctx.start = start
        ctx.in_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        z, target, log_z, entropy = ctx.saved_tensors
        vocab_local = z.shape[-1]
        # The same products in the same order as -(g_H p (log p + H)) - g_logp p + one-hot, each
        # vocabulary-sized temporary reused in place (bit-equal to the out-of-place form).
        log_p = z - log_z.unsqueeze(-1)
        p = torch.exp(log_p)
        grad = None
        if grad_entropy is not None:
            safe_log_p = log_p.masked_fill_((p > 0).logical_not_(), 0.0).add_(entropy.unsqueeze(-1))
            grad = (grad_entropy.unsqueeze(-1) * p).mul_(safe_log_p).neg_()
            del safe_log_p, log_p
        if grad_logp is not None:
            step = grad_logp.unsqueeze(-1) * p
            grad = step.neg_() if grad is None else grad.sub_(step)
            in_slice = (target >= ctx.start) & (target < ctx.start + vocab_local)
            local_index = (target - ctx.start).clamp(0, vocab_local - 1).unsqueeze(-1)
            hit = torch.where(in_slice, grad_logp, torch.zeros_like(grad_logp)).unsqueeze(-1)
            grad.scatter_add_(-1, local_index, hit)
        if grad is None:
            grad = torch.zeros_like(z)
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_logprobs_entropy(
    logits_local_BTV: torch.Tensor,
    target_BT: torch.Tensor,
    tp_group: Any = None,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT) in fp32 from this TP rank's vocab slice of the logits.

    `target_BT` holds global token ids. `tp_group=None` means the logits hold the whole
    vocabulary. `vocab_size` (the unpadded vocabulary) masks Megatron's padding rows.
    """
    assert logits_local_BTV.shape[:-1] == target_BT.shape, (logits_local_BTV.shape, target_BT.shape)
    return _VocabParallelLogprobEntropy.apply(logits_local_BTV, target_BT, tp_group, vocab_size)


def logprobs_entropy_reference(
    logits_BTV: torch.Tensor, target_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary definition the vocab-parallel version is tested against."""
    logp_all = torch.log_softmax(logits_BTV.float(), dim=-1)
    logp = torch.gather(logp_all, -1, target_BT.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
