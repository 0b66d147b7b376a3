"""The token ids a rollout stops at: `rollout.stop_token_ids` plus the model's end ids.

A model trained to end its turn writes an end token (SmolLM2-Instruct's `<|im_end|>`, Llama-2's
`</s>`); generation stops there by default, as it does in transformers, vLLM and SGLang. The end
ids are config.json's `eos_token_id` united with generation_config.json's (both of
`model.hf_path`) and the run's tokenizer's; `rollout.ignore_eos: true` leaves only
`rollout.stop_token_ids`. The response keeps the end token as its last token (finish reason
"stop"), so the loss and the reward see nothing after it.

Synthetic tasks speak token ids and have no end id (their vocabularies reserve one, which a
recipe opts into with `rollout.stop_token_ids`): with no `data.train_files` the stop ids are
`rollout.stop_token_ids` alone, so the tiny-model quickstarts generate as they always did.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from rl3d.data.tokenizer import tokenizer_path
from rl3d.utils.imports import is_import_path


def model_eos_token_ids(model_path: str | None) -> frozenset[int]:
    """config.json's `eos_token_id` united with generation_config.json's (each an id or a list;
    what SGLang's ModelConfig._get_hf_eos_token_id reads too)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path or "") / name
        if not model_path or not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            ids |= {value} if isinstance(value, int) else set(value)
    return frozenset(int(i) for i in ids)


@functools.lru_cache(maxsize=8)
def _tokenizer_eos_id(path: str) -> int | None:
    """The EOS id of the HF tokenizer in `path`; None when it has none or does not load (the
    run loads the same tokenizer for its prompts, `rl3d.data.load_tokenizer`, and that load
    reports why before anything is generated)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None
    return tokenizer.eos_token_id


def end_token_ids(data: Any, model_path: str | None) -> frozenset[int]:
    """The model's end ids for a run's `data` section and `model.hf_path`: none for synthetic
    tasks."""
    path = tokenizer_path(data, model_path)
    if not data.train_files or path is None or is_import_path(path):
        return frozenset()
    ids = set(model_eos_token_ids(model_path))
    eos = _tokenizer_eos_id(str(path))
    if eos is not None:
        ids.add(int(eos))
    return frozenset(ids)


def stop_token_ids(rollout: Any, data: Any, model_path: str | None) -> tuple[int, ...]:
    """What a run stops at: its `rollout` section's `stop_token_ids`, then (unless
    `rollout.ignore_eos`) the model's end ids (`end_token_ids(data, model_path)`), in ascending
    order."""
    ends = () if rollout.ignore_eos else sorted(end_token_ids(data, model_path))
    return tuple(dict.fromkeys([*rollout.stop_token_ids, *ends]))
