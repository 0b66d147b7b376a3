"""Any HF model in and out: a Qwen2-architecture model whose shapes are in no registry trains
from its HF directory (`model.name` unset) and comes back out with `rl3d export`."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import GRPO, metrics_by_step, run_train, train_env

pytestmark = pytest.mark.e2e

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def own_qwen2(tmp_path_factory):
    """Random fp32 Qwen2 (GQA 6/2 heads, hidden 48, vocab 200 padded to 256 at tp=2, untied,
    rope theta 5e5) with a tokenizer, saved with save_pretrained."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(
        vocab_size=200,
        hidden_size=48,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=5e5,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # every tensor random (biases too), so a dropped or swapped one shows
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    directory = tmp_path_factory.mktemp("own_qwen2") / "hf"
    model.save_pretrained(str(directory))
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, 200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
        str(directory)
    )
    assert all((directory / name).is_file() for name in TOKENIZER_FILES)
    return directory


def train_own(run_dir, hf_dir, *overrides):
    proc = run_train(
        GRPO,
        run_dir,
        "model.name=null",  # the recipe's models/tiny_llama block names a registry shape
        f"model.hf_path={hf_dir}",
        "trainer.total_steps=2",
        "checkpoint.save_every=2",
        *overrides,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(metrics_by_step(run_dir)) == [1, 2]


def export(run_dir, dst, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), "--dst", str(dst), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=train_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from step 2 of {run_dir}" in proc.stdout
    return dst


def assert_same_tensors(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_own_qwen2_trains_and_exports_bit_for_bit_at_lr_0(own_qwen2, tmp_path):
    # OptimConfig refuses lr <= 0; an Adam step of at most 1e-30 is below every weight's fp32 ulp
    # (all weights are random, none is 0), so the weights cannot move
    run_dir = tmp_path / "run"
    train_own(run_dir, own_qwen2, "actor.optim.lr=1.0e-30")
    out = export(run_dir, tmp_path / "export")
    assert_same_tensors(out, own_qwen2)
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (own_qwen2 / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_key_value_heads"] == 2


def megatron_logits(rank, world_size, hf_dir, checkpoint, ids):
    """rl3d's actor from the training checkpoint through megatron's own (layout-aware) loader."""
    from types import SimpleNamespace

    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.dist_checkpoint import load_checkpoint
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout

    spec = spec_of(SimpleNamespace(name=None, hf_path=hf_dir))
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1)
    model = build_gpt(spec, groups)
    load_checkpoint(checkpoint, ddp=model, optimizer=None, scheduler=None, groups=groups)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : spec.vocab_size]
    destroy_megatron()
    return logits


def test_trained_export_loads_in_transformers_with_the_actors_logits(own_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl3d.testing.spawn import run_distributed

    run_dir = tmp_path / "run"
    train_own(run_dir, own_qwen2, "checkpoint.save_hf=true")  # the recipe's lr 1e-3
    step_dir = run_dir / "checkpoints" / "step_00000002"
    out = export(run_dir, tmp_path / "export", "--step", "2")
    assert_same_tensors(out, step_dir / "hf")  # save_hf and `rl3d export` write the same model
    trained, start = load_file(out / "model.safetensors"), load_file(own_qwen2 / "model.safetensors")
    assert not torch.equal(
        trained["model.layers.0.self_attn.q_proj.bias"], start["model.layers.0.self_attn.q_proj.bias"]
    )
    ids = torch.randint(0, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    (ours,) = run_distributed(megatron_logits, 1, str(own_qwen2), str(step_dir / "actor"), ids, timeout_s=300)
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"transformers(export) vs rl3d actor logits: max |diff| = {diff:.3g}")
    assert diff < 1e-5, diff
