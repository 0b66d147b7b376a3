"""The torch rollout engine on a CUDA device (skipped without CUDA): fp32 log-probs equal HF
transformers' on the same device within 1e-4 (GPU attention/matmul kernels differ from the eager
reference more than on CPU), seeded determinism, finished rows dropped.

The SGLang adapter's GPU check is `test_sglang_engine.py`; it builds its weights with
`megatron_weights` from here.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_LOGPROB_TOL = 1e-4
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [1], [64, 65]]


def megatron_weights(name, device, dtype=torch.float32, seed=0):
    """(spec, params by name, full t=1 Megatron tensors on `device`): random, moderate scale."""
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import full_model
    from rl3d.models.spec import get_model_spec

    spec = get_model_spec(name)
    params = model_params(spec, train_tp=1)
    full = full_model(params, seed=seed, dtype=torch.float32)
    full = {
        k: ((1 + 0.1 * v) if k.endswith("norm.weight") else 0.15 * v).to(device, dtype)
        for k, v in full.items()
    }
    if spec.tied_embeddings:
        full.pop("output_layer.weight")
    return spec, {p.name: p for p in params}, full


def _hf(spec, full):
    from transformers import AutoModelForCausalLM

    from rl3d.rollout.sglang_weights import megatron_to_hf

    state = {k: v for name, t in full.items() for k, v in megatron_to_hf(spec, name, [t])}
    from rl3d.models.hf_mapping import hf_config_from_spec

    config = hf_config_from_spec(spec)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.float().cpu() for k, v in state.items()}, strict=False)
    return model.to(next(iter(full.values())).device).eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_torch_engine_on_gpu_matches_hf(name):
    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    spec, _, full = megatron_weights(name, "cuda")
    engine = TorchRolloutEngine(spec, full)
    params = SamplingParams(max_new_tokens=12, n=2, seed=3, stop_token_ids=(7, 8, 9))
    batch = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert torch.equal(batch.response_ids, again.response_ids)
    model = _hf(spec, full)
    worst = 0.0
    for row, resp in enumerate(batch.responses()):
        prompt = PROMPTS[int(batch.prompt_index[row])]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + resp], device="cuda")).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp, device="cuda")[:, None])
        worst = max(worst, (ref.squeeze(-1).cpu() - batch.logprobs[row, : len(resp)]).abs().max().item())
    assert worst <= GPU_LOGPROB_TOL, worst
    assert engine.stats.decode_rows == int((batch.lengths - 1).sum())
