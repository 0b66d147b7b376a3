"""A tiny megatron GPTModel at CP 2 with ring attention against the same weights at CP 1, fp32.

Two gloo ranks. At CP 1 (the two ranks then data replicas) each rank computes the logits of the
whole left-padded batch with megatron's local spec; at CP 2 the same weights run with the local
spec's core attention replaced by ring attention (`with_ring_attention`), each rank given its
part of the tokens and of the [b, 1, s, s] mask by megatron's `get_batch_on_this_cp_rank`
(RoPE cut by megatron's own CP slicing). The rank's logits equal the CP 1 logits of its positions
within 1e-6 (measured 7.5e-8: the softmax sums are merged differently), and the parameters'
gradients of a weighted sum of the logits, summed over the CP ranks (as megatron's DDP reduces
over DP x CP), equal CP 1's within 1e-6 of each parameter's largest gradient entry (measured
2.9e-7; the largest absolute difference is 1.5e-5).
megatron's process groups are built here directly: rl3d's layouts have no CP dimension yet.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, S, VOCAB = 2, 16, 64
PAD = (0, 6)
TOL = 1e-6
GRAD_TOL = 1e-6  # relative to each parameter's largest gradient entry


def build(cp):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from rl3d.models.ring_attention import with_ring_attention

    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=True)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        context_parallel_size=cp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        normalization="RMSNorm",
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if cp > 1:
        spec = with_ring_attention(spec)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=S,
        position_embedding_type="rope",
        pg_collection=pgs,
    )


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
