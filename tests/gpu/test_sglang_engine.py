"""The SGLang rollout adapter on a CUDA device: the ready-to-run check of the SGLang engine.

Skipped without CUDA, and without SGLang (`pip install 'rl3d[gpu]'`, pinned sglang==0.5.23).
It starts a tiny SGLang engine from a random HF checkpoint, pushes other weights from the
3D-HybridEngine's `GenerationWeights` (the planned flattened buckets over CUDA IPC) and checks that they land
(`get_weights_by_name`), that greedy output matches rl3d's torch engine on the same weights, and
that release / reload keeps the engine working with the same output (every memory tag resumed).
"""

import pytest
import torch
from test_rollout_gpu import PROMPTS, megatron_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_sglang_adapter_push_generate_release(tmp_path):
    sglang = pytest.importorskip("sglang")
    from rl3d.hybrid_engine.engine_push import plan_engine_push, push_mismatch
    from rl3d.hybrid_engine.weights import GenerationWeights
    from rl3d.rollout import SamplingParams, TorchRolloutEngine, make_rollout_engine
    from rl3d.rollout.sglang_weights import check_sglang, megatron_to_hf
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    check_sglang(sglang)
    spec, params, full = megatron_weights("tiny-llama", "cuda", torch.bfloat16, seed=5)
    save_tiny_hf_model(spec, tmp_path, seed=1, dtype=torch.bfloat16)  # other weights to start from
    weights = GenerationWeights(
        spec=spec,
        params=params,
        train_tp=1,
        gen_tp=1,
        gen_tp_rank=0,
        pieces={n: [t] for n, t in full.items()},
    )
    push = plan_engine_push(spec, list(params.values()), 1, dtype="bfloat16", bucket_bytes=int(0.05 * 2**20))
    engine = make_rollout_engine(
        "sglang", spec=spec, model_path=str(tmp_path), mem_fraction_static=0.2, push_plan=push,
        engine_kwargs=dict(disable_cuda_graph=True, random_seed=0),
    )  # fmt: skip
    try:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in engine.launch_env["set_by_sglang"]  # given back to rank 0
        with pytest.raises(RuntimeError, match="released"):  # the engine starts released
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        assert push_mismatch(push, engine.load_weights(weights)) is None  # the planned buckets
        engine.resume_memory()  # the KV cache, after every rank emptied its allocator cache
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
        with pytest.raises(RuntimeError, match="released"):
            engine.generate(PROMPTS, greedy)
        engine.load_weights(weights)
        engine.resume_memory()
        assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, theirs.response_ids)
        engine.pause()  # the KV cache only: the weights stay
        with pytest.raises(RuntimeError, match="kv_cache"):
            engine.generate(PROMPTS, greedy)
        engine.resume_memory()
        assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, theirs.response_ids)
        sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=1))
        assert sampled.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert (sampled.logprobs[sampled.mask()] <= 0).all()
        # the agent endpoint's top_logprobs: each token's alternatives, most likely first, the
        # sampled token among them with its very log-prob (the same original softmax)
        top = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=2, top_logprobs=3))
        assert top.top_ids.shape == (*top.response_ids.shape, 3)
        hits = 0
        for row, alternatives in enumerate(top.token_top()):
            for step, alts in enumerate(alternatives):
                lps = [lp for _, lp in alts]
                assert lps == sorted(lps, reverse=True)
                token = int(top.response_ids[row, step])
                if token in [i for i, _ in alts]:
                    assert dict(alts)[token] == pytest.approx(float(top.raw_logprobs[row, step]), abs=1e-6)
                    hits += 1
        assert hits > 0
    finally:
        engine.shutdown()
