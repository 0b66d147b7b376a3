"""The torch engine on the real SmolLM2-135M-Instruct at generation tp 3 (9 heads / 3 KV heads:
one KV head a rank; the 49152-row vocab split three ways) gives the one-process engine's greedy
tokens on 8 chat prompts, and their log-probs within what fp32 arithmetic supports, on every rank.
(The one-process engine equals transformers' `generate`: tests/unit/rollout/test_rollout_real_model.py.)

The bound, derived rather than the last value seen: tp 3 computes the same function in fp32 as
one process, in another order (row-parallel sums of three partial products, a log-softmax over
three vocab shards). Each order's result has its own rounding error against the exact value, which
the one-process engine in float64 stands for here. The one-process fp32 engine's error `err_fp32`
is measured on these prompts; tp 3's error is of the same size (asserted: at most 2 x err_fp32), so
by the triangle inequality their difference is at most 3 x err_fp32. On this model that is about
3e-5 (err_fp32 about 1e-5: 30 layers of fp32 sums over hidden 576 and the 49152-way log-softmax,
on log-probs near -10); a fixed 1e-5 sat at the one-process engine's own error and failed at 1.49e-5.
"""

import pytest

from rl3d.testing.real_model import chat_prompt_ids, megatron_tensors
from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SAME_SIZE = 2.0  # tp 3's error against float64, in units of the one-process fp32 engine's
EOS = 2


def greedy():
    from rl3d.rollout import SamplingParams

    return SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(EOS,))


def tp_worker(rank, world, hf_dir, prompts):
    import torch.distributed as dist

    from rl3d.rollout import TorchRolloutEngine

    spec, shards = megatron_tensors(hf_dir, tp=world, tp_rank=rank)
    engine = TorchRolloutEngine(spec, shards, group=dist.group.WORLD, pad_token_id=EOS)
    batch = engine.generate(prompts, greedy())
    return batch.responses(), batch.raw_logprobs


def agreeing(reference, exact):
    """[N, L] bool over `reference`'s responses: the positions where `exact` sampled the same
    tokens so far (float64 may break a near-tie of the greedy argmax differently; past that, the
    prefixes differ and so do the log-probs' arguments)."""
    import torch

    width = min(reference.response_ids.shape[1], exact.response_ids.shape[1])
    same = torch.zeros_like(reference.mask())
    same[:, :width] = (reference.response_ids[:, :width] == exact.response_ids[:, :width]) & (
        reference.mask()[:, :width] & exact.mask()[:, :width]
    )
    return same.long().cumprod(dim=1).bool()


def pad_to(values, width):
    import torch

    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    out[:, : min(width, values.shape[1])] = values[:, :width]
    return out


def test_generation_tp3_equals_one_process(smollm2_dir):
    import torch

    from rl3d.rollout import TorchRolloutEngine

    prompts = chat_prompt_ids(smollm2_dir)
    spec, full = megatron_tensors(smollm2_dir)
    reference = TorchRolloutEngine(spec, full, pad_token_id=EOS).generate(prompts, greedy())
    exact = TorchRolloutEngine(spec, full, pad_token_id=EOS, dtype=torch.float64).generate(prompts, greedy())
    del full
    mask = reference.mask()
    near_exact = agreeing(reference, exact)
    exact_logprobs = pad_to(exact.raw_logprobs, mask.shape[1])
    assert near_exact.sum() >= mask.sum() // 2, "float64 and fp32 greedy tokens parted early"
    err_fp32 = (reference.raw_logprobs - exact_logprobs)[near_exact].abs().max().item()
    results = run_distributed(tp_worker, 3, str(smollm2_dir), prompts, timeout_s=900)
    for responses, raw in results:
        assert responses == reference.responses()
        err_tp = (raw - exact_logprobs)[near_exact].abs().max().item()
        diff = (raw - reference.raw_logprobs)[mask].abs().max().item()
        assert err_tp <= SAME_SIZE * err_fp32, (err_tp, err_fp32)
        assert diff <= (1 + SAME_SIZE) * err_fp32, (diff, err_fp32)
    print(
        f"generation tp3 = tp1 on 8 chat prompts; log-prob |diff| {diff:.3g} <= 3 x {err_fp32:.3g} "
        f"(fp32 against float64); tp3 against float64 {err_tp:.3g}"
    )
