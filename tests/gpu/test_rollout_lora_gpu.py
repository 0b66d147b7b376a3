"""The torch engine with LoRA adapters on a CUDA device (skipped without CUDA): in both modes the
fp32 log-probs equal the same engine's on CPU within 1e-4, whose own equality with transformers +
peft the CPU tests pin (tests/unit/rollout/test_rollout_lora.py)."""

import pytest
import torch
from test_rollout_gpu import GPU_LOGPROB_TOL, PROMPTS, megatron_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def random_adapter(spec, device, rank=8, seed=0):
    from rl3d.models.lora_names import LORA_TARGETS, peft_key
    from rl3d.models.lora_shapes import factor_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in LORA_TARGETS:
            for factor, shape in zip("AB", factor_shapes(spec, module, rank)):
                x = 0.2 * torch.randn(shape, generator=gen)
                tensors[peft_key(layer, module, factor)] = x.to(device)
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS)}


@pytest.mark.parametrize("mode", ["apply", "merge"])
def test_adapted_engine_on_gpu_equals_cpu(mode):
    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = {}
    for device in ("cpu", "cuda"):
        spec, _, full = megatron_weights("tiny-llama", device)
        engine = TorchRolloutEngine(spec, full, lora_mode=mode)
        engine.load_lora(*random_adapter(spec, device))
        batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=2))
        out[device] = (batch.response_ids, batch.logprobs, engine.generate(PROMPTS, params).response_ids)
    (cpu_ids, cpu_lp, cpu_greedy), (gpu_ids, gpu_lp, gpu_greedy) = out["cpu"], out["cuda"]
    assert torch.equal(cpu_greedy, gpu_greedy)
    same = (cpu_ids == gpu_ids).all(dim=1)  # sampled rows that chose the same tokens
    assert same.any()
    assert (cpu_lp[same] - gpu_lp[same]).abs().max().item() <= GPU_LOGPROB_TOL
