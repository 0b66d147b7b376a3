"""The torch engine on the real SmolLM2-135M-Instruct: greedy generation equals transformers'
greedy `generate` token for token on 8 chat prompts (chat template with the generation prompt),
both stopping at the model's end token `<|im_end|>` (id 2) or at MAX_NEW_TOKENS."""

import pytest
import torch

from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.testing.real_model import chat_prompt_ids, megatron_tensors

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 40
EOS = 2


def transformers_greedy(hf_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            done = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=EOS, pad_token_id=EOS,
            )  # fmt: skip
            out.append(done[0, len(prompt) :].tolist())
    return out


def test_greedy_generation_equals_transformers_generate(smollm2_dir, one_torch_thread):
    prompts = chat_prompt_ids(smollm2_dir)
    spec, weights = megatron_tensors(smollm2_dir)
    engine = TorchRolloutEngine(spec, weights, pad_token_id=EOS)
    batch = engine.generate(
        prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=(EOS,))
    )
    theirs = transformers_greedy(smollm2_dir, prompts)
    for prompt, ours, reference, reason in zip(prompts, batch.responses(), theirs, batch.finish_reasons):
        assert ours == reference, (prompt, ours, reference)
        assert reason == ("stop" if ours[-1] == EOS else "length")
    stopped = sum(r == "stop" for r in batch.finish_reasons)
    print(f"8 chat prompts: greedy equal token for token; {stopped} stopped at <|im_end|>")
    assert stopped >= 2  # the comparison covers the end token, not only the length limit
