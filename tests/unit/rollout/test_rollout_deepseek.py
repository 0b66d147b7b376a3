"""The torch engine on DeepSeek-V3 (tiny: multi-latent attention with its compressed KV cache, a
dense first layer, the grouped sigmoid router with its correction bias, a shared expert) against
transformers' DeepseekV3ForCausalLM of the same random weights (fp32): sampled log-probs (prefill
and decode from the latent cache) equal HF's within 1e-5, greedy tokens equal HF `generate`'s,
and the cache holds one latent + rope key per token and layer, not per-head keys and values."""

import pytest
import torch
from safetensors.torch import load_file
from test_rollout_hf_generate import PROMPTS as GREEDY_PROMPTS
from test_rollout_hf_generate import hf_greedy
from test_rollout_torch_engine import PROMPTS, reference_logprobs

from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.spec import get_model_spec
from rl3d.parallel.sharding import padded_vocab_size
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.model import ShardedWeights
from rl3d.testing.tiny_hf import save_tiny_hf_model

SPEC = get_model_spec("tiny-deepseek-v3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, the engine's tensors): the HF checkpoint converted by rl3d's own mapping."""
    path = tmp_path_factory.mktemp("hf") / "tiny-deepseek-v3"
    model = save_tiny_hf_model(SPEC, path, seed=7)
    hf = load_file(path / "model.safetensors")
    maps = tensor_maps(SPEC, padded_vocab_size(SPEC.vocab_size, 1))
    return model, {m.mcore: m.to_mcore([hf[n] for n in m.hf]) for m in maps}


def test_logprobs_match_hf(tiny):
    model, tensors = tiny
    batch = TorchRolloutEngine(SPEC, tensors).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, n=2, seed=3)
    )
    worst = 0.0
    for row, (resp, lps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        ref = reference_logprobs(model, PROMPTS[int(batch.prompt_index[row])], resp)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    assert worst <= 1e-5, worst


def test_greedy_equals_hf_generate_from_the_latent_cache(tiny):
    model, tensors = tiny
    engine = TorchRolloutEngine(SPEC, tensors)
    batch = engine.generate(GREEDY_PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    for prompt, ours in zip(GREEDY_PROMPTS, batch.responses()):
        assert ours == hf_greedy(model, prompt, 10), prompt
    # per layer and token one KV head of the latent (32) and the rope key (8)
    assert engine.cache.k.shape[2:] == (1, engine.cache.k.shape[3], SPEC.kv_lora_rank + SPEC.qk_rope_head_dim)


def test_mla_runs_at_generation_tp_1_only(tiny):
    _, tensors = tiny
    halves = {n: t[: t.shape[0] // 2] if t.dim() else t for n, t in tensors.items()}
    with pytest.raises(ValueError, match="cannot be split over t_g=2"):
        ShardedWeights.from_tensors(SPEC, halves, tp_size=2, tp_rank=0)
