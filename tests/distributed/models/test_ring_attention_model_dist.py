"""A tiny GPT from rl3d's builder at CP 2 with ring attention against the same weights at CP 1, fp32.

Two gloo ranks, rl3d's `build_gpt` (tiny-qwen2: GQA, tied embeddings, qkv bias). At CP 1 (the two
ranks then data replicas) each rank computes the logits of the whole left-padded batch with
megatron's local spec; at CP 2 the builder makes the local spec with its core
attention replaced by ring attention (`with_ring_attention`), loads the CP 1 weights, and each rank gets its
part of the tokens and of the [b, 1, s, s] mask by megatron's `get_batch_on_this_cp_rank`
(RoPE cut by megatron's own CP slicing). The rank's logits equal the CP 1 logits of its positions
within 1e-6 (measured 3.6e-7: the softmax sums are merged differently), and the parameters'
gradients of a weighted sum of the logits, summed over the CP ranks (as megatron's DDP reduces
over DP x CP), equal CP 1's within 1e-6 of each parameter's largest gradient entry (measured
4.4e-7). megatron's groups come from `init_megatron`: CP 1 as `ParallelLayout(1, 1, 2)`, CP 2 as
`ParallelLayout(1, 1, 1, cp=2)`.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, S, VOCAB = 2, 16, 256
PAD = (0, 6)
TOL = 1e-6
GRAD_TOL = 1e-6  # relative to each parameter's largest gradient entry


def build(cp, world):
    """tiny-qwen2 (8 query heads over 2 key-value groups) from rl3d's builder on megatron's groups
    with CP `cp` (the other ranks data replicas)."""
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel.layout import ParallelLayout

    groups = init_megatron(ParallelLayout(p=1, t=1, d=world // cp, cp=cp), seed=1)
    return build_gpt(get_model_spec("tiny-qwen2"), groups), groups


def batch():
    gen = torch.Generator().manual_seed(3)
    pos = torch.arange(S)
    pad = pos[None, :] < torch.tensor(PAD)[:, None]
    mask = (pos[None, :] > pos[:, None])[None] | pad[:, None, :]
    return {
        "tokens": torch.randint(0, VOCAB, (B, S), generator=gen),
        "position_ids": pos.expand(B, S).contiguous(),
        "attention_mask": mask[:, None],
    }


def worker(rank, world):
    from megatron.core.utils import get_batch_on_this_cp_rank

    from rl3d.models.bootstrap import destroy_megatron
    from rl3d.models.ring_attention import cp_positions

    full = batch()
    model, _ = build(1, world)  # init_megatron seeds alike on both ranks: at CP 2 they are one model
    weights = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    logits_full = model(full["tokens"], full["position_ids"], full["attention_mask"])
    w = torch.randn(logits_full.shape, generator=torch.Generator().manual_seed(5))
    (logits_full * w).sum().backward()
    grads_full = {name: p.grad.clone() for name, p in model.named_parameters()}
    logits_full = logits_full.detach()
    destroy_megatron()

    model, groups = build(world, world)
    missing = model.load_state_dict(weights, strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    local = get_batch_on_this_cp_rank(batch(), cp_group=groups.cp_group)
    logits = model(local["tokens"], local["position_ids"], local["attention_mask"])
    pos = cp_positions(S, world, rank)
    (logits * w[:, pos]).sum().backward()
    grad_diff = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        torch.distributed.all_reduce(grad, group=groups.cp_group)
        scale = grads_full[name].abs().max().item()
        grad_diff = max(grad_diff, (grad - grads_full[name]).abs().max().item() / scale)
    destroy_megatron()
    return (logits.detach() - logits_full[:, pos]).abs().max().item(), grad_diff


def test_tiny_gpt_at_cp2_equals_cp1():
    results = run_distributed(worker, 2, timeout_s=300)
    logits_diff = max(r[0] for r in results)
    grad_diff = max(r[1] for r in results)
    print(f"max |logits(CP 2) - logits(CP 1)|: {logits_diff}, relative of the gradients: {grad_diff}")
    assert logits_diff <= TOL, results
    assert grad_diff <= GRAD_TOL, results
