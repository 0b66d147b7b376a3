"""Rollout engines on a CUDA device. Skipped without CUDA; the SGLang part also needs SGLang
(`pip install 'rl3d[gpu]'`, pinned sglang==0.5.23).

- torch engine on the GPU: fp32 log-probs equal HF transformers' on the same device within
  1e-4 (GPU attention/matmul kernels differ from the eager reference more than on CPU), seeded
  determinism, finished rows dropped;
- SGLang adapter: weights pushed from the 3D-HybridEngine's `GenerationWeights` (flattened
  buckets over CUDA IPC) land in the engine (checked with `get_weights_by_name`), greedy output
  matches the torch engine on the same weights, and release/resume keeps working.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_LOGPROB_TOL = 1e-4
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [1], [64, 65]]


def _megatron(name, device, dtype=torch.float32, seed=0):
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

    spec, _, full = _megatron(name, "cuda")
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


def test_sglang_adapter_push_generate_release(tmp_path):
    sglang = pytest.importorskip("sglang")
    from rl3d.hybrid_engine.weights import GenerationWeights
    from rl3d.rollout import SamplingParams, TorchRolloutEngine, make_rollout_engine
    from rl3d.rollout.sglang_weights import check_sglang, megatron_to_hf
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    check_sglang(sglang)
    spec, params, full = _megatron("tiny-llama", "cuda", torch.bfloat16, seed=5)
    save_tiny_hf_model(spec, tmp_path, seed=1, dtype=torch.bfloat16)  # other weights to start from
    weights = GenerationWeights(
        spec=spec,
        params=params,
        train_tp=1,
        gen_tp=1,
        gen_tp_rank=0,
        pieces={n: [t] for n, t in full.items()},
    )
    engine = make_rollout_engine(
        "sglang", spec=spec, model_path=str(tmp_path), mem_fraction_static=0.2, bucket_mb=0.05,
        engine_kwargs=dict(disable_cuda_graph=True, random_seed=0),
    )  # fmt: skip
    try:
        engine.load_weights(weights)
        fc2 = "decoder.layers.1.mlp.linear_fc2.weight"
        name, expect = megatron_to_hf(spec, fc2, [full[fc2]])[0]
        got = torch.tensor(engine.engine.get_weights_by_name(name, truncate_size=4)).float()
        assert torch.allclose(got, expect[:4].float().cpu(), atol=1e-2)  # the first rows, as pushed
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        ours = TorchRolloutEngine(spec, full).generate(PROMPTS, greedy)
        theirs = engine.generate(PROMPTS, greedy)
        assert theirs.finish_reasons == ["length"] * len(PROMPTS)
        first = (theirs.response_ids[:, 0] == ours.response_ids[:, 0]).float().mean().item()
        assert first >= 0.75, (theirs.responses(), ours.responses())  # bf16 kernels may flip near-ties
        engine.release_memory()
        engine.load_weights(weights)
        engine.resume_memory()
        assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, theirs.response_ids)
        sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=1))
        assert sampled.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert (sampled.logprobs[sampled.mask()] <= 0).all()
    finally:
        engine.shutdown()
