"""Log-probs and entropy from (vocab-parallel) logits equal log_softmax on the full logits."""

import pytest
import torch

from rl3d.models.logprobs import logprobs_entropy_reference, vocab_parallel_logprobs_entropy


def _case(seed=0, B=3, T=5, V=37, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * scale
    target = torch.randint(0, V, (B, T), generator=gen)
    return logits, target


def test_equals_log_softmax():
    logits, target = _case()
    logp, entropy = vocab_parallel_logprobs_entropy(logits, target)
    ref_logp, ref_entropy = logprobs_entropy_reference(logits, target)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(entropy, dist.entropy(), rtol=0, atol=1e-5)


def test_padded_vocab_rows_are_masked():
    logits, target = _case(V=40)
    padded = torch.cat([logits, torch.full((3, 5, 24), 3.0)], dim=-1)  # Megatron pads to 64
    logp, entropy = vocab_parallel_logprobs_entropy(padded, target, vocab_size=40)
    ref_logp, ref_entropy = logprobs_entropy_reference(logits, target)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_autograd_of_reference(dtype):
    logits, target = _case(seed=1)
    logits = logits.to(dtype)
    weights = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    ours = logits.clone().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_entropy(ours, target)
    (weights[0] * logp + weights[1] * entropy).sum().backward()
    ref_logp, ref_entropy = logprobs_entropy_reference(ref, target)
    (weights[0] * ref_logp + weights[1] * ref_entropy).sum().backward()
    assert ours.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.grad.float(), ref.grad.float(), rtol=0, atol=tol)


def test_backward_only_logp_and_padded():
    logits, target = _case(seed=3, V=30)
    padded = torch.cat([logits, torch.zeros(3, 5, 2)], dim=-1).requires_grad_(True)
    logp, _ = vocab_parallel_logprobs_entropy(padded, target, vocab_size=30)
    logp.sum().backward()
    ref = logits.clone().requires_grad_(True)
    logprobs_entropy_reference(ref, target)[0].sum().backward()
    torch.testing.assert_close(padded.grad[..., :30], ref.grad, rtol=0, atol=1e-6)
    assert torch.all(padded.grad[..., 30:] == 0)


def test_fp64_temporaries_cover_a_bounded_chunk_of_rows_and_change_no_value(monkeypatch):
    """At most CHUNK_BYTES of fp64 rows at a time (a 152k vocabulary would otherwise make tens
    of GB); the values are bit for bit those of one whole-batch pass, on a strided slice too."""
    import rl3d.models.logprobs as lp

    logits, target = _case(B=4, T=9, V=53)
    sliced = logits[:, 2:7]  # like the response slice of a model's output: not contiguous
    whole = vocab_parallel_logprobs_entropy(sliced, target[:, 2:7], vocab_size=50)
    seen = []
    partial_sums = lp._partial_sums
    monkeypatch.setattr(lp, "_partial_sums", lambda z, *a: seen.append(z.shape[0]) or partial_sums(z, *a))
    monkeypatch.setattr(lp, "CHUNK_BYTES", 3 * 8 * 53)  # three rows of fp64 per chunk
    chunked = vocab_parallel_logprobs_entropy(sliced, target[:, 2:7], vocab_size=50)
    assert seen == [3] * 6 + [2]  # 20 rows
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def _out_of_place_grad(logits, target, grad_logp, grad_entropy, vocab_size):
    """The backward's formula written out of place, one new tensor per operation: the in-place
    backward must equal it bit for bit."""
    z = logits.float().masked_fill(torch.arange(logits.shape[-1]) >= vocab_size, float("-inf"))
    _, entropy = vocab_parallel_logprobs_entropy(logits, target, vocab_size=vocab_size)
    z_max = z.max(-1).values
    log_z = (
        z_max.double() + torch.log(torch.exp(z - z_max.unsqueeze(-1)).sum(-1, dtype=torch.float64))
    ).float()
    log_p = z - log_z.unsqueeze(-1)
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    if grad_entropy is not None:
        safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))
        grad = grad - grad_entropy.unsqueeze(-1) * p * (safe_log_p + entropy.unsqueeze(-1))
    if grad_logp is not None:
        grad = grad - grad_logp.unsqueeze(-1) * p
        grad = grad.scatter_add(-1, target.unsqueeze(-1), grad_logp.unsqueeze(-1))
    return grad


@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_in_place_backward_equals_the_out_of_place_formula(which):
    logits, target = _case(B=4, T=6, V=53, seed=5)
    target = target % 50  # real tokens: the last 3 rows are padding
    gen = torch.Generator().manual_seed(6)
    grad_logp = torch.randn(4, 6, generator=gen) if which != "entropy" else None
    grad_entropy = torch.randn(4, 6, generator=gen) if which != "logp" else None
    leaf = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_entropy(leaf, target, vocab_size=50)
    outputs = [o for o, g in ((logp, grad_logp), (entropy, grad_entropy)) if g is not None]
    torch.autograd.backward(outputs, [g for g in (grad_logp, grad_entropy) if g is not None])
    want = _out_of_place_grad(logits, target, grad_logp, grad_entropy, vocab_size=50)
    assert torch.equal(leaf.grad, want)
    assert torch.all(leaf.grad[..., 50:] == 0)
