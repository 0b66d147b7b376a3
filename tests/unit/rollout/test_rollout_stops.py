"""Stop ids: the model's end ids (config.json, generation_config.json, the tokenizer) by default
for text data, none for synthetic tasks, `rollout.ignore_eos` and `rollout.stop_token_ids`."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl3d.config import load_config
from rl3d.rollout.stops import end_token_ids, stop_token_ids
from rl3d.testing.chat import EOS_ID as CHAT_EOS_ID
from rl3d.testing.chat import save_chat_tokenizer

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A model directory (config.json eos 2, generation_config.json eos [2, 5]), a chat tokenizer
    (EOS `<|im_end|>` = 3) and a text parquet file."""
    root = tmp_path_factory.mktemp("stops")
    model = root / "model"
    model.mkdir()
    _write_config(model, "tiny-llama", eos_token_id=2)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    data = root / "train.parquet"
    pq.write_table(pa.table({"prompt": ["what is two ?"]}), data)
    return {"model": model, "tok": save_chat_tokenizer(root / "tok"), "data": data}


def _write_config(directory, spec_name, **ids):
    """config.json of model `spec_name`'s shapes (what the config checks read), with `ids`."""
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.spec import get_model_spec

    config = hf_config_from_spec(get_model_spec(spec_name)).to_dict() | ids
    (directory / "config.json").write_text(json.dumps(config))


def _cfg(recipe, *overrides):
    return load_config(recipe, list(overrides)).config


def _stops(cfg):
    return stop_token_ids(cfg.rollout, cfg.data, cfg.model.hf_path)


def test_text_data_stops_at_the_model_and_tokenizer_end_ids(inputs):
    text = [f"data.train_files=[{inputs['data']}]", f"data.tokenizer={inputs['tok']}"]
    # model.hf_path is not loaded here: only its two JSON files are read
    cfg = _cfg(GRPO, *text, f"model.hf_path={inputs['model']}")
    assert _stops(cfg) == (2, CHAT_EOS_ID, 5)
    assert _stops(_cfg(GRPO, *text)) == (CHAT_EOS_ID,)  # no model directory: the tokenizer's
    cfg = _cfg(GRPO, *text, f"model.hf_path={inputs['model']}", "rollout.stop_token_ids=[9,5]")
    assert _stops(cfg) == (9, 5, 2, CHAT_EOS_ID)  # the recipe's first, then the end ids
    cfg = _cfg(GRPO, *text, f"model.hf_path={inputs['model']}", "rollout.ignore_eos=true")
    assert _stops(cfg) == () and end_token_ids(cfg.data, cfg.model.hf_path) == {2, 3, 5}


# the synthetic-task quickstarts (the SmolLM2 one is text data: it stops at the model's EOS)
SYNTHETIC_QUICKSTARTS = [
    p for p in sorted((ROOT / "recipes").glob("quickstart_cpu_*.yaml")) if "smollm2" not in p.stem
]


@pytest.mark.parametrize("recipe", SYNTHETIC_QUICKSTARTS, ids=lambda p: p.stem)
def test_cpu_quickstarts_stop_where_they_always_did(recipe):
    """Synthetic tasks have no end id: their stops are the recipe's own list, unchanged."""
    loaded = load_config(recipe, [])
    cfg = loaded.config
    if not hasattr(cfg, "rollout"):  # the reward-model jobs generate nothing
        return
    assert not cfg.data.train_files and _stops(cfg) == tuple(cfg.rollout.stop_token_ids)


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("gpu_*.yaml")), ids=lambda p: p.stem)
def test_gpu_recipes_stop_at_the_model_eos(recipe, tmp_path):
    """The GPU recipes name Llama-2 directories: resolved against Llama-2's files (config.json
    and generation_config.json say eos_token_id 2; its tokenizer's EOS `</s>` is id 2), they
    stop at 2, by default, with no stop ids of their own."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tmp_path / "Llama-2-hf"
    model.mkdir()
    _write_config(model, load_config(recipe, []).config.model.name, bos_token_id=1, eos_token_id=2)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
    ).save_pretrained(str(model))
    cfg = _cfg(recipe, f"model.hf_path={model}")  # its own data.train_files: text data
    assert cfg.data.train_files and not cfg.rollout.ignore_eos and not cfg.rollout.stop_token_ids
    assert _stops(cfg) == (2,)


def test_sglang_gets_the_same_stops_with_eos_on(inputs):
    """SGLang stops at the model's EOS ids (config.json, generation_config.json) unless
    ignore_eos, which also turns its stop ids off: with the resolved stops the model's EOS ids
    are among them, so ignore_eos stays off and SGLang stops exactly where the torch engine does."""
    from rl3d.rollout import SamplingParams
    from rl3d.rollout.sglang_weights import to_sglang_sampling
    from rl3d.rollout.stops import model_eos_token_ids

    text = [f"data.train_files=[{inputs['data']}]", f"data.tokenizer={inputs['tok']}"]
    eos = model_eos_token_ids(str(inputs["model"]))
    assert eos == {2, 5}
    cfg = _cfg(GRPO, *text, f"model.hf_path={inputs['model']}")
    sampling = to_sglang_sampling(SamplingParams(stop_token_ids=_stops(cfg)), 0, eos)
    assert sampling["ignore_eos"] is False and sampling["stop_token_ids"] == [2, CHAT_EOS_ID, 5]
    cfg = _cfg(GRPO, *text, f"model.hf_path={inputs['model']}", "rollout.ignore_eos=true")
    sampling = to_sglang_sampling(SamplingParams(stop_token_ids=_stops(cfg)), 0, eos)
    assert sampling["ignore_eos"] is True and sampling["stop_token_ids"] is None
    cfg = _cfg(
        GRPO,
        *text,
        f"model.hf_path={inputs['model']}",
        "rollout.ignore_eos=true",
        "rollout.stop_token_ids=[9]",
    )
    with pytest.raises(
        ValueError, match=r"SGLang also stops at the model's EOS ids \[2, 5\].*drop ignore_eos"
    ):
        to_sglang_sampling(SamplingParams(stop_token_ids=_stops(cfg)), 0, eos)


def test_the_real_smollm2_stops_at_im_end(smollm2_dir, inputs):
    """config.json, generation_config.json and the tokenizer of SmolLM2-135M-Instruct all name
    `<|im_end|>` (id 2)."""
    from transformers import AutoTokenizer

    cfg = _cfg(
        GRPO,
        f"model.hf_path={smollm2_dir}",
        "model.name=null",
        "actor.parallel.tp=1",
        "launch.nproc_per_node=1",
        f"data.train_files=[{inputs['data']}]",
    )
    assert _stops(cfg) == (2,)
    assert AutoTokenizer.from_pretrained(str(smollm2_dir)).convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_the_launcher_says_where_generation_stops(inputs):
    from rl3d.launch.train import describe

    text = [f"data.train_files=[{inputs['data']}]", f"data.tokenizer={inputs['tok']}"]
    line = describe(load_config(GRPO, [*text, f"model.hf_path={inputs['model']}"])).splitlines()[5]
    assert line == (
        "stops        at token ids [2, 3, 5] (the model's end ids [2, 3, 5] and rollout.stop_token_ids), "
        "else after 8 tokens"
    )
    line = describe(load_config(GRPO, [])).splitlines()[5]
    assert line == (
        "stops        at token ids none (rollout.stop_token_ids; a synthetic task has no end id), "
        "else after 8 tokens"
    )
