"""The torch engine on Qwen3 (q/k norm, head width != hidden / heads), Qwen3-MoE and Qwen2-MoE
(shared expert), against HF transformers' own models of the same random weights (fp32, eager).

Sampled log-probs (prefill: the first token; decode with the KV cache: the rest) equal HF's
log_softmax at the same tokens within 1e-5, and greedy tokens equal HF `generate`'s.
"""

import pytest
import torch
from hf_to_engine import tiny_hf_model
from test_rollout_hf_generate import PROMPTS as GREEDY_PROMPTS
from test_rollout_hf_generate import hf_greedy
from test_rollout_torch_engine import PROMPTS, reference_logprobs

from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.model import ShardedWeights
from rl3d.rollout.moe import engine_param_names

LOGPROB_TOL = 1e-5  # fp32
MODELS = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe"]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    return tiny_hf_model(request.param)


def test_logprobs_match_hf(tiny):
    spec, model, tensors = tiny
    batch = TorchRolloutEngine(spec, tensors).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, n=2, seed=3)
    )
    worst = 0.0
    for row, (resp, lps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        ref = reference_logprobs(model, PROMPTS[int(batch.prompt_index[row])], resp)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    assert worst <= LOGPROB_TOL, worst


def test_greedy_equals_hf_generate(tiny):
    spec, model, tensors = tiny
    new_tokens = 10
    batch = TorchRolloutEngine(spec, tensors).generate(
        GREEDY_PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    )
    for prompt, ours in zip(GREEDY_PROMPTS, batch.responses()):
        assert ours == hf_greedy(model, prompt, new_tokens), prompt


def test_engine_needs_every_moe_parameter(tiny):
    spec, _, tensors = tiny
    names = engine_param_names(spec)
    assert sorted(names) == sorted(tensors)
    if spec.is_moe:
        assert not any(n.endswith("mlp.linear_fc1.weight") and "experts" not in n for n in names)
    for missing in [n for n in names if "layers.1." in n]:
        with pytest.raises(ValueError, match="lack"):
            ShardedWeights.from_tensors(spec, {n: t for n, t in tensors.items() if n != missing})
