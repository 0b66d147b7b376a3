"""The torch engine with a LoRA adapter on the real SmolLM2-135M-Instruct against transformers +
peft: rank 16 on all seven projections, random nonzero factors, saved by `save_pretrained` and read
back. Log-probs of sampled chat responses (prefill and decode) equal the reference in fp32, in the
apply and the merge mode, within 3e-5: the engine without adapters is itself 1.8e-5 from
transformers on these prompts (fp32 summation order over 30 layers and a 49k vocabulary), and the
adapted engine must stay within twice its own base's distance from transformers."""

import pytest
import torch

from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.testing.lora import hf_logprobs, peft_adapter
from rl3d.testing.real_model import chat_prompt_ids, megatron_tensors

pytestmark = pytest.mark.slow
LOGPROB_TOL = 3e-5  # fp32, 30 layers


def test_adapted_real_model_equals_transformers_peft(smollm2_dir, one_torch_thread, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = chat_prompt_ids(smollm2_dir)[:3]
    spec, weights = megatron_tensors(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    params = SamplingParams(max_new_tokens=12, seed=7)
    plain = TorchRolloutEngine(spec, weights).generate(prompts, params)
    floor = worst_error(plain, model, prompts)  # the engine's own distance from transformers
    peft_model, tensors, config = peft_adapter(model, tmp_path, rank=16, alpha=32, scale=0.02)
    for mode in ("apply", "merge"):
        engine = TorchRolloutEngine(spec, weights, lora_mode=mode)
        engine.load_lora(tensors, config)
        batch = engine.generate(prompts, params)
        assert not torch.equal(batch.logprobs, plain.logprobs), mode
        worst = worst_error(batch, peft_model, prompts)
        assert worst <= min(LOGPROB_TOL, 2 * max(floor, 1e-5)), (mode, worst, floor)


def worst_error(batch, model, prompts):
    rows = zip(prompts, batch.responses(), batch.token_logprobs())
    return max((torch.tensor(lps) - hf_logprobs(model, p, resp)).abs().max().item() for p, resp, lps in rows)
