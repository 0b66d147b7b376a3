"""The torch engine with LoRA adapters against HF transformers + the real `peft` package.

The reference is `get_peft_model` on the HF model built from the same Megatron weights, with
random nonzero lora_B; its adapters are saved with `save_pretrained` and read back from disk,
exactly what the engine receives. The engine's per-token log-probs (prefill and decode) must
equal the reference's within 1e-5 in fp32, in both the apply and the merge mode.
"""

import pytest
import torch
from test_rollout_torch_engine import PROMPTS, hf_reference, megatron_model, reference_logprobs

from rl3d.models.lora_names import peft_key as peft_name
from rl3d.models.lora_shapes import module_shape
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.lora import LORA_TARGETS, AdapterConfig, megatron_low_rank
from rl3d.testing.lora import peft_adapter

LOGPROB_TOL = 1e-5  # fp32
TARGETS = list(LORA_TARGETS)


def worst_logprob_error(batch, model, prompts=PROMPTS):
    worst = 0.0
    for row, (resp, lps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        ref = reference_logprobs(model, prompts[int(batch.prompt_index[row])], resp)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_adapted_engine_equals_hf_peft(name, tmp_path):
    spec, _, full = megatron_model(name)
    peft_model, tensors, config = peft_adapter(hf_reference(spec, full), tmp_path)
    assert any(k.endswith("q_proj.lora_A.weight") for k in tensors)  # PEFT's own saved names
    params = SamplingParams(max_new_tokens=10, n=2, seed=3)
    base = {k: v.clone() for k, v in full.items()}
    plain = TorchRolloutEngine(spec, full).generate(PROMPTS, params)
    for mode in ("apply", "merge"):
        engine = TorchRolloutEngine(spec, full, lora_mode=mode)
        engine.load_lora(tensors, config)
        batch = engine.generate(PROMPTS, params)
        assert worst_logprob_error(batch, peft_model) <= LOGPROB_TOL, mode
        assert not torch.equal(batch.logprobs, plain.logprobs)  # the adapters do change the model
        assert all(torch.equal(full[k], base[k]) for k in full), mode  # the base is never written
        engine.clear_lora()
        again = engine.generate(PROMPTS, params)
        assert torch.equal(again.response_ids, plain.response_ids)
        assert torch.equal(again.logprobs, plain.logprobs)


def test_partial_targets_and_new_adapters_each_step(tmp_path):
    """Attention-only adapters; then a second adapter replaces the first (no leftover delta)."""
    spec, _, full = megatron_model("tiny-llama")
    params = SamplingParams(max_new_tokens=8, seed=1)
    engines = {mode: TorchRolloutEngine(spec, full, lora_mode=mode) for mode in ("apply", "merge")}
    for step, targets in enumerate((["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"])):
        peft_model, tensors, config = peft_adapter(
            hf_reference(spec, full), tmp_path / str(step), rank=4, alpha=8, targets=targets, seed=step
        )
        for mode, engine in engines.items():
            engine.load_lora(tensors, config)
            batch = engine.generate(PROMPTS, params)
            assert worst_logprob_error(batch, peft_model) <= LOGPROB_TOL, (step, mode)
    merged = engines["merge"].lora
    assert merged.copy_bytes == sum(
        p.nbytes for n in merged.factors for p in engines["merge"].weights.pieces[n]
    )
    assert engines["apply"].lora.copy_bytes == 0


def test_fused_delta_equals_peft_modules():
    """delta W of the fused QKV / fc1 in Megatron's layout is each HF module's scale * B @ A."""
    from rl3d.models.hf_mapping import tensor_maps

    spec, _, full = megatron_model("tiny-llama")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for module in TARGETS:
        for layer in range(spec.num_layers):
            out, inp = module_shape(spec, module)
            tensors[peft_name(layer, module, "A")] = torch.randn(4, inp, generator=gen)
            tensors[peft_name(layer, module, "B")] = torch.randn(out, 4, generator=gen)
    config = {"r": 4, "lora_alpha": 12, "target_modules": TARGETS}
    factors = megatron_low_rank(spec, tensors, config)
    maps = {m.mcore: m for m in tensor_maps(spec, full["embedding.word_embeddings.weight"].shape[0])}
    for name, lr in factors.items():
        for hf_name, delta in zip(maps[name].hf, maps[name].to_hf(lr.delta())):
            prefix = "base_model.model." + hf_name.removesuffix(".weight")
            expect = 3.0 * tensors[prefix + ".lora_B.weight"] @ tensors[prefix + ".lora_A.weight"]
            torch.testing.assert_close(delta, expect, rtol=1e-5, atol=1e-5)


def test_bad_adapters_name_the_tensor_or_key():
    spec, _, _ = megatron_model("tiny-llama")
    a = torch.zeros(4, spec.hidden_size)
    good = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match="lora_A only"):
        megatron_low_rank(spec, {peft_name(0, "q_proj", "A"): a}, good)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight.*expected A"):
        megatron_low_rank(spec, {peft_name(0, "q_proj", "A"): a[:, :3], peft_name(0, "q_proj", "B"): a}, good)
    with pytest.raises(ValueError, match="not a PEFT lora_A/lora_B"):
        megatron_low_rank(spec, {"model.layers.0.self_attn.q_proj.weight": a}, good)
    with pytest.raises(ValueError, match="rank_pattern"):
        AdapterConfig.from_peft({**good, "rank_pattern": {"q_proj": 2}})
    with pytest.raises(ValueError, match="target_modules"):
        AdapterConfig.from_peft({**good, "target_modules": ["qkv"]})
    with pytest.raises(RuntimeError, match="load_weights"):
        TorchRolloutEngine(spec).load_lora({}, good)
    with pytest.raises(ValueError, match="LoRA mode"):
        TorchRolloutEngine(spec, lora_mode="fuse")
