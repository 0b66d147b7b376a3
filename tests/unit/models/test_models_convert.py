"""HF <-> Megatron conversion on CPU without process groups: bit-for-bit round trips."""

import json

import pytest
import torch
from safetensors import safe_open

from rl3d.models.convert import META_NAME, McoreMeta, McoreReader, hf_to_mcore, mcore_to_hf, shard_dir_name
from rl3d.models.hf_mapping import hf_config_from_spec, spec_from_hf_config
from rl3d.models.safetensors_io import INDEX_NAME, ShardedReader, StreamingWriter
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import padded_vocab_size
from rl3d.testing.tiny_hf import save_tiny_hf_model


def _tensors(directory):
    with ShardedReader(directory) as reader:
        return {name: reader.get(name) for name in reader.weight_map}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_for_bit(tiny_hf_dirs, tmp_path, name, tp, pp):
    src = tiny_hf_dirs[name]
    meta = hf_to_mcore(src, tmp_path / "mcore", tp=tp, pp=pp)
    assert (meta.tp, meta.pp, meta.padded_vocab) == (tp, pp, padded_vocab_size(256, tp))
    for r in range(tp):
        for s in range(pp):
            assert (tmp_path / "mcore" / shard_dir_name(r, s) / "model.safetensors").exists()
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    before, after = _tensors(src), _tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def test_round_trip_bf16_multi_file_output(tmp_path):
    src = tmp_path / "src"
    save_tiny_hf_model("tiny-llama-odd-vocab", src, seed=1, dtype=torch.bfloat16)
    hf_to_mcore(src, tmp_path / "mcore", tp=2, pp=2)
    with safe_open(str(tmp_path / "mcore" / shard_dir_name(1, 0) / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("embedding.word_embeddings.weight")
    assert emb.dtype == torch.bfloat16 and emb.shape == (128, 64)  # 250 padded to 256, half
    assert torch.all(emb[250 - 128 :] == 0)  # padding rows are zero
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    before, after = _tensors(src), _tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_converted_directory_loads_in_transformers(tiny_hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_hf_dirs["tiny-qwen2"]
    hf_to_mcore(src, tmp_path / "mcore", tp=2, pp=2)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src)(ids).logits
        out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    assert torch.equal(ref, out)


def test_reader_reshards(tiny_hf_dirs, tmp_path):
    hf_to_mcore(tiny_hf_dirs["tiny-llama"], tmp_path / "a", tp=2, pp=2)
    hf_to_mcore(tiny_hf_dirs["tiny-llama"], tmp_path / "b", tp=1, pp=1)
    with McoreReader(tmp_path / "a") as a, McoreReader(tmp_path / "b") as b:
        for name in ("decoder.layers.1.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"):
            assert torch.equal(a.full(name)[:256], b.full(name)[:256])
            assert torch.equal(a.shard(name, 1, 0, 256), b.full(name))
    meta = McoreMeta.read(tmp_path / "a")
    assert meta.model_type == "llama" and meta.spec.num_query_groups == 4


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported HF model_type 'gpt2'.*llama, qwen2"):
        hf_to_mcore(tmp_path, tmp_path / "out", tp=1, pp=1)


def test_not_a_megatron_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=META_NAME):
        mcore_to_hf(tmp_path, tmp_path / "out")


def test_bad_layout(tiny_hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="do not split into 3 stages"):
        hf_to_mcore(tiny_hf_dirs["tiny-llama"], tmp_path / "x", tp=1, pp=3)
    with pytest.raises(ValueError, match="tp=8 must divide the KV heads"):
        hf_to_mcore(tiny_hf_dirs["tiny-llama"], tmp_path / "x", tp=8, pp=1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-mha"])
def test_spec_from_hf_config_round_trip(name):
    spec = get_model_spec(name)
    back = spec_from_hf_config(hf_config_from_spec(spec).to_dict(), name=name)
    assert back == spec


def test_spec_from_hf_config_rejects_unsupported():
    cfg = hf_config_from_spec(get_model_spec("tiny-llama")).to_dict()
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        spec_from_hf_config({**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        spec_from_hf_config({**cfg, "attention_bias": True})


def test_streaming_writer_checks_plan(tmp_path):
    plan = [("a", torch.float32, (2,)), ("b", torch.bfloat16, (1, 3))]
    writer = StreamingWriter(tmp_path / "x.safetensors", plan)
    writer.write("a", torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError):
        writer.write("a", torch.zeros(2))
    writer.write("b", torch.ones(1, 3, dtype=torch.bfloat16))
    writer.close()
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.tensor([1.0, 2.0]))
        assert f.get_tensor("b").dtype == torch.bfloat16
    short = StreamingWriter(tmp_path / "y.safetensors", plan)
    short.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="never written"):
        short.close()
