"""The GPU recipes stop at the model's end of turn: their rollout keeps the default (stop at the
model's EOS ids), and the SGLang engine is told so (`stop_token_ids` with EOS among them,
`ignore_eos` off), for a Llama-2 checkpoint directory (config.json: eos_token_id 2)."""

import json
from pathlib import Path

import pytest

from rl3d.config import load_config
from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.spec import get_model_spec
from rl3d.rollout.sglang_weights import to_sglang_sampling
from rl3d.rollout.stops import model_eos_token_ids
from rl3d.workers.generation import rollout_sampling

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("gpu_*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_gpu_recipe_stops_at_eos_in_sglang(recipe, tmp_path):
    cfg = load_config(recipe).config
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_from_spec(get_model_spec(cfg.model.name)).to_dict()))
    cfg = load_config(recipe, [f"model.hf_path={hf}"]).config
    assert cfg.rollout.engine == "sglang" and not cfg.rollout.ignore_eos and cfg.data.train_files
    params = rollout_sampling(cfg, step=1, gen_dp_rank=0)
    sampling = to_sglang_sampling(params, 0, model_eos_token_ids(str(hf)))
    assert 2 in sampling["stop_token_ids"] and sampling["ignore_eos"] is False
    assert sampling["max_new_tokens"] == cfg.rollout.max_new_tokens
