"""The torch engine on the real SmolLM2-135M-Instruct at generation tp 3 (9 heads / 3 KV heads:
one KV head a rank; the 49152-row vocab split three ways) gives the one-process engine's greedy
tokens on 8 chat prompts, and their log-probs within 1e-5, on every rank. (The one-process
engine equals transformers' `generate`: tests/unit/rollout/test_rollout_real_model.py.)"""

import pytest

from rl3d.testing.real_model import chat_prompt_ids, megatron_tensors
from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LOGPROB_TOL = 1e-5
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


def test_generation_tp3_equals_one_process(smollm2_dir):
    from rl3d.rollout import TorchRolloutEngine

    prompts = chat_prompt_ids(smollm2_dir)
    spec, full = megatron_tensors(smollm2_dir)
    reference = TorchRolloutEngine(spec, full, pad_token_id=EOS).generate(prompts, greedy())
    del full
    results = run_distributed(tp_worker, 3, str(smollm2_dir), prompts, timeout_s=900)
    for responses, raw in results:
        assert responses == reference.responses()
        mask = reference.mask()
        diff = (raw - reference.raw_logprobs)[mask].abs().max().item()
        assert diff <= LOGPROB_TOL, diff
    print(f"generation tp3 = tp1 on 8 chat prompts; log-prob |diff| <= {diff:.3g}")
