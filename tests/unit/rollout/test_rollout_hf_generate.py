"""Greedy decoding of the torch engine equals HF transformers' `generate`, token for token.

The same random Megatron weights run in the engine (all prompts in one left-padded batch,
temperature 0) and, converted with rl3d's mapping, in `transformers` (fp32, eager attention,
its own KV cache, one unpadded prompt at a time, `do_sample=False`). Neither side stops early:
the engine gets no stop tokens and HF gets `eos_token_id=None` with `min_new_tokens` equal to
`max_new_tokens`, so both return exactly `max_new_tokens` tokens per prompt.
"""

import pytest
import torch
from test_rollout_torch_engine import hf_reference, megatron_model

from rl3d.rollout import SamplingParams, TorchRolloutEngine

NEW_TOKENS = 16
# lengths 1 to 23, so the engine's batch holds rows with 0 to 22 left-padding slots
PROMPTS = [
    [5, 17, 3],
    [200, 9, 31, 44, 2, 7, 99],
    [1],
    [64, 65],
    list(range(10, 33)),
    [250, 0, 128, 7, 7, 7, 19, 88, 3, 41, 160, 2],
]


def hf_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-odd-vocab"])
def test_greedy_equals_hf_generate(name):
    spec, _, full = megatron_model(name)
    prompts = [[t % spec.vocab_size for t in p] for p in PROMPTS]
    batch = TorchRolloutEngine(spec, full).generate(
        prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    )
    assert batch.finish_reasons == ["length"] * len(prompts)
    model = hf_reference(spec, full)
    for prompt, ours in zip(prompts, batch.responses()):
        theirs = hf_greedy(model, prompt, NEW_TOKENS)
        assert len(theirs) == NEW_TOKENS
        assert ours == theirs, (prompt, ours, theirs)
