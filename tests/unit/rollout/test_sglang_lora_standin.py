"""The SGLang adapter's LoRA push on the CPU stand-in of the pinned wheel (`sglang_standin`):
the engine starts with LoRA enabled and sized, keeps the base it was pushed once, and each
`load_lora` unloads the previous adapter and loads the new one by tensors (no file); requests
name the adapter, and `clear_lora` gives the base's outputs back."""

from sglang_standin import install
from sglang_wheel import wheel_or_skip

from rl3d.hybrid_engine.engine_push import plan_engine_push
from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import GenerationWeights
from rl3d.models.lora_names import LORA_TARGETS
from rl3d.models.spec import get_model_spec
from rl3d.rollout import SamplingParams
from rl3d.rollout.sglang_engine import SGLangRolloutEngine
from rl3d.testing.lora import megatron_from_hf, peft_adapter
from rl3d.testing.tiny_hf import save_tiny_hf_model

PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 5, 8]]


def test_adapters_go_through_the_lora_api(tmp_path, monkeypatch, sigquit_restored):
    standin = install(monkeypatch, wheel_or_skip())
    spec = get_model_spec("tiny-llama")
    model = save_tiny_hf_model(spec, tmp_path / "hf", seed=3)
    params = {p.name: p for p in model_params(spec, train_tp=1)}
    full = megatron_from_hf(spec, model, params["embedding.word_embeddings.weight"].shape[0])
    weights = GenerationWeights(spec, params, 1, 1, 0, {n: [t] for n, t in full.items()})
    lora = {"r": 8, "lora_alpha": 16, "target_modules": list(LORA_TARGETS)}
    push = plan_engine_push(spec, list(params.values()), 1, dtype="float32", bucket_bytes=2**20)
    engine = SGLangRolloutEngine(
        spec, model_path=str(tmp_path / "hf"), push_plan=push, lora=lora, deterministic=True,
        dtype="float32", base_gpu_id=0, gpu_id_step=1,
    )  # fmt: skip
    (sglang,) = standin.engines
    assert sglang.args["enable_lora"] and sglang.args["max_lora_rank"] == 8
    assert sglang.args["lora_target_modules"] == list(LORA_TARGETS)
    assert [names for names, _ in engine.load_weights(weights).buckets] == [b.names for b in push.buckets]
    engine.resume_memory()
    params = SamplingParams(max_new_tokens=4, seed=1)
    base = engine.generate(PROMPTS, params)

    adapted = []
    for step in range(2):
        peft_model, tensors, config = peft_adapter(model, tmp_path / f"a{step}", seed=step)
        model = peft_model.unload()  # the plain HF model again, for the next adapter
        sglang.events.clear()
        engine.load_lora(tensors, config)
        adapted.append(engine.generate(PROMPTS, params))
        loads = [e for e in sglang.events if e[0] in ("load_lora", "unload_lora")]
        expected = [("load_lora", "rl3d-lora-1")] if step == 0 else [
            ("unload_lora", "rl3d-lora-1"), ("load_lora", "rl3d-lora-2"),
        ]  # fmt: skip
        assert loads == expected, loads
        assert sglang.events.index(("flush",)) > sglang.events.index(loads[-1])  # no stale prefix
    assert list(sglang.loras) == ["rl3d-lora-2"]  # one adapter held at a time
    assert adapted[0].response_ids.tolist() != base.response_ids.tolist()
    assert adapted[0].response_ids.tolist() != adapted[1].response_ids.tolist()
    engine.clear_lora()
    assert not sglang.loras
    again = engine.generate(PROMPTS, params)
    assert again.response_ids.tolist() == base.response_ids.tolist()
    engine.shutdown()
