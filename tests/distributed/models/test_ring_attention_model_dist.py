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
4.4e-7).
megatron's process groups are built here directly: rl3d's layouts have no CP dimension yet.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, S, VOCAB = 2, 16, 256
PAD = (0, 6)
TOL = 1e-6
GRAD_TOL = 1e-6  # relative to each parameter's largest gradient entry


def build(cp):
    """tiny-qwen2 (8 query heads over 2 key-value groups) from rl3d's builder on megatron's groups
    with CP `cp`; the groups are made here by hand since rl3d's layouts have no CP yet."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl3d.models.bootstrap import MegatronGroups
    from rl3d.models.builder import build_gpt
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel.layout import ParallelLayout

    parallel_state.initialize_model_parallel(
        context_parallel_size=cp, order="tp-cp-ep-dp-pp", create_gloo_process_groups=True
    )
    model_parallel_cuda_manual_seed(1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    layout = ParallelLayout(p=1, t=1, d=1)  # one replica, whose sequence the CP ranks split
    groups = MegatronGroups(
        layout=layout,
        rank=0,
        coords=layout.coords(0),
        tp_group=pgs.tp,
        pp_group=pgs.pp,
        dp_group=pgs.dp,
        mp_group=pgs.mp,
        embedding_group=pgs.embd,
        pg_collection=pgs,
    )
    return build_gpt(get_model_spec("tiny-qwen2"), groups)


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
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from rl3d.models import cpu_shim
    from rl3d.models.ring_attention import cp_positions

    cpu_shim.activate("cpu")
    full = batch()
    torch.manual_seed(0)  # the same weights on both ranks: at CP 2 they are one model
    model = build(1)
    weights = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    logits_full = model(full["tokens"], full["position_ids"], full["attention_mask"])
    w = torch.randn(logits_full.shape, generator=torch.Generator().manual_seed(5))
    (logits_full * w).sum().backward()
    grads_full = {name: p.grad.clone() for name, p in model.named_parameters()}
    logits_full = logits_full.detach()
    parallel_state.destroy_model_parallel()

    model = build(world)
    missing = model.load_state_dict(weights, strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    local = get_batch_on_this_cp_rank(batch(), cp_group=parallel_state.get_context_parallel_group())
    logits = model(local["tokens"], local["position_ids"], local["attention_mask"])
    pos = cp_positions(S, world, rank)
    (logits * w[:, pos]).sum().backward()
    grad_diff = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        scale = grads_full[name].abs().max().item()
        grad_diff = max(grad_diff, (grad - grads_full[name]).abs().max().item() / scale)
    parallel_state.destroy_model_parallel()
    return (logits.detach() - logits_full[:, pos]).abs().max().item(), grad_diff


def test_tiny_gpt_at_cp2_equals_cp1():
    results = run_distributed(worker, 2)
    logits_diff = max(r[0] for r in results)
    grad_diff = max(r[1] for r in results)
    print(f"max |logits(CP 2) - logits(CP 1)|: {logits_diff}, relative of the gradients: {grad_diff}")
    assert logits_diff <= TOL, results
    assert grad_diff <= GRAD_TOL, results
