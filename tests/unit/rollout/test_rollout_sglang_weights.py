"""The SGLang adapter's pure parts on CPU (SGLang itself needs CUDA and is not imported):
Megatron -> HF names and layout, bucket flattening, version and API checks."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import full_model
from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.sglang_weights import (
    REQUIRED_ENGINE_API,
    SGLANG_VERSION,
    SGLangVersionError,
    check_engine_api,
    check_sglang_version,
    flatten_bucket,
    megatron_to_hf,
    to_sglang_sampling,
    unflatten_bucket,
)

ROOT = Path(__file__).resolve().parents[3]


def _model(name, tp):
    spec = get_model_spec(name)
    params = model_params(spec, train_tp=tp)
    full = full_model(params, seed=2, dtype=torch.float32)
    full = {k: (1 + 0.1 * v) if k.endswith("norm.weight") else 0.15 * v for k, v in full.items()}
    if spec.tied_embeddings:
        full.pop("output_layer.weight")
    return spec, {p.name: p for p in params}, full


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-odd-vocab"])
def test_megatron_shards_to_hf_model(name):
    """The HF tensors built from t=2 shards load into a transformers model (strict names and
    shapes) whose logits equal the torch engine's on the Megatron weights."""
    from transformers import AutoModelForCausalLM

    spec, params, full = _model(name, tp=2)
    state = {}
    for mname, t in full.items():
        shards = [shard_for_tp(t, params[mname].kind, 2, r) for r in range(2)]
        for hf_name, hf_t in megatron_to_hf(spec, mname, shards):
            assert hf_name not in state
            state[hf_name] = hf_t
    assert state["model.embed_tokens.weight"].shape[0] == spec.vocab_size  # padding removed
    model = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if spec.tied_embeddings else set())
    for key, value in model.state_dict().items():
        assert value.shape == state.get(key, state["model.embed_tokens.weight"]).shape, key
    prompt = [3, 1, 4, 1, 5, 9]
    greedy = TorchRolloutEngine(spec, full).generate(
        [prompt], SamplingParams(max_new_tokens=5, temperature=0)
    )
    ids = torch.tensor([prompt + greedy.responses()[0]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == greedy.responses()[0]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(greedy.responses()[0])[:, None]).squeeze(-1)
    assert (ref - greedy.raw_logprobs[0]).abs().max().item() <= 1e-5


def test_qkv_and_fc1_conversion_by_hand():
    spec, params, full = _model("tiny-llama", tp=1)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    hd, hpg, groups = spec.head_dim, spec.heads_per_group, spec.num_query_groups
    out = dict(megatron_to_hf(spec, "decoder.layers.0.self_attention.linear_qkv.weight", [qkv]))
    g1 = qkv.view(groups, hpg + 2, hd, -1)[1]  # query group 1: hpg q heads, then k, then v
    assert torch.equal(
        out["model.layers.0.self_attn.q_proj.weight"][hpg * hd : 2 * hpg * hd], g1[:hpg].flatten(0, 1)
    )
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"][hd : 2 * hd], g1[hpg])
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"][hd : 2 * hd], g1[hpg + 1])
    fc1 = full["decoder.layers.1.mlp.linear_fc1.weight"]
    shards = [
        shard_for_tp(fc1, params["decoder.layers.1.mlp.linear_fc1.weight"].kind, 2, r) for r in range(2)
    ]
    out = dict(megatron_to_hf(spec, "decoder.layers.1.mlp.linear_fc1.weight", shards))
    f = spec.ffn_hidden_size
    assert torch.equal(out["model.layers.1.mlp.gate_proj.weight"], fc1[:f])
    assert torch.equal(out["model.layers.1.mlp.up_proj.weight"], fc1[f:])


def test_flattened_buckets_roundtrip():
    """Buckets are planned with the transition (tests/unit/hybrid_engine/test_engine_push.py);
    here a bucket of mixed shapes and dtypes flattens and comes back bit for bit."""
    gen = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate([10, 20, 5])]
    named += [("matrix", torch.randn(4, 2, generator=gen)), ("half", torch.randn(3, generator=gen).half())]
    for bucket in (named[:4], named[4:]):
        flat, entries = flatten_bucket(bucket)
        assert flat.dim() == 1 and flat.numel() == sum(t.numel() for _, t in bucket)
        assert entries[0].start_idx == 0 and entries[-1].end_idx == flat.numel()
        for (name, t), (name2, back), e in zip(bucket, unflatten_bucket(flat, entries), entries):
            assert name == name2 == e.name and e.dtype == t.dtype and e.numel == t.numel()
            assert torch.equal(back, t)


def test_bucket_entry_has_sglang_metadata_fields():
    # FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel) in sglang 0.5.x
    _, entries = flatten_bucket([("a", torch.zeros(2, 3))])
    assert list(entries[0].__dataclass_fields__) == [
        "name",
        "shape",
        "dtype",
        "start_idx",
        "end_idx",
        "numel",
    ]


def test_version_pin_matches_setup_py():
    pins = re.findall(r"sglang==([0-9][0-9a-z.]*)", (ROOT / "setup.py").read_text())
    assert pins == [SGLANG_VERSION]


def test_version_check():
    check_sglang_version(SGLANG_VERSION)
    check_sglang_version(SGLANG_VERSION + "+cu128")
    for bad in ["0.5.22", "0.5.24", "0.4.6.post1", "1.0.0"]:
        with pytest.raises(SGLangVersionError, match=f"sglang=={SGLANG_VERSION}"):
            check_sglang_version(bad)
    with pytest.raises(SGLangVersionError, match="unparsable"):
        check_sglang_version("not-a-version")


class _GoodEngine:
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 top_logprobs_num=None, lora_path=None): ...  # fmt: skip
    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict=None): ...
    def unload_lora_adapter(self, lora_name): ...
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="g", flush_cache=True): ...
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"): ...  # fmt: skip
    def begin_weight_update(self, selector="all"): ...
    def end_weight_update(self): ...
    def release_memory_occupation(self, tags=None): ...
    def resume_memory_occupation(self, tags=None): ...
    def flush_cache(self): ...
    def shutdown(self): ...


class _OldEngine(_GoodEngine):
    # an older API: positional tensor list under another name, no tags, no flush flag
    def update_weights_from_tensor(self, tensors, load_format=None): ...
    def release_memory_occupation(self): ...


def test_engine_api_check():
    check_engine_api(_GoodEngine)
    with pytest.raises(SGLangVersionError) as err:
        check_engine_api(_OldEngine)
    msg = str(err.value)
    assert "update_weights_from_tensor" in msg and "named_tensors" in msg and "flush_cache" in msg
    assert "release_memory_occupation" in msg and "tags" in msg
    assert "resume_memory_occupation" not in msg

    class Missing(_GoodEngine):
        flush_cache = None

    with pytest.raises(SGLangVersionError, match="Engine.flush_cache is missing"):
        check_engine_api(Missing)
    assert set(REQUIRED_ENGINE_API) >= {"generate", "update_weights_from_tensor", "release_memory_occupation"}
    assert all(inspect.signature(getattr(_GoodEngine, m)) for m in REQUIRED_ENGINE_API)


def test_sampling_params_translation():
    d = to_sglang_sampling(SamplingParams(temperature=0.7, top_k=0, top_p=0.9, max_new_tokens=9,
                                          stop_token_ids=[2], seed=5), 3)  # fmt: skip
    assert d["top_k"] == -1 and d["stop_token_ids"] == [2] and d["max_new_tokens"] == 9
    assert d["sampling_seed"] != to_sglang_sampling(SamplingParams(seed=5), 4)["sampling_seed"]
    assert "sampling_seed" not in to_sglang_sampling(SamplingParams(), 0)


def test_sglang_engine_without_sglang_is_a_clear_error():
    import importlib.util

    from rl3d.rollout import make_rollout_engine

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    with pytest.raises(ImportError, match=r"rl3d\[gpu\]"):
        make_rollout_engine("sglang", spec=get_model_spec("tiny-llama"), model_path="unused")
