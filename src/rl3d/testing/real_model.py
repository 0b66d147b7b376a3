"""The real model in tests: its fetched HF directory (or a pytest skip that says why not), chat
prompts through its tokenizer's template, and rl3d's actor log-probs and transformers' on the
same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2-135m"
# Eight user turns of different lengths and kinds (arithmetic, facts, code, instructions).
CHAT_PROMPTS = (
    "What is 12 + 7?",
    "Name the capital of France.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "Tom has 3 apples and buys 5 more. How many apples does he have? End with '#### <answer>'.",
    "Hi!",
    "Explain in one sentence why the sky is blue.",
)


def real_model_dir(name: str = SMOLLM2) -> Path:
    """`rl3d.models.hub.ensure_model(name)`; where it cannot be fetched here, skip the test."""
    import pytest

    from rl3d.models.hub import FetchError, ensure_model

    try:
        return ensure_model(name)
    except FetchError as err:
        pytest.skip(f"real model {name} unavailable (`rl3d models fetch {name}` failed): {err}")


def chat_prompt_ids(hf_dir: str | Path, prompts: tuple[str, ...] = CHAT_PROMPTS) -> list[list[int]]:
    """Each prompt as one user turn through the chat template, with the generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def sequence_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Any:
    """The actor's batch layout: [left-padded prompt | right-padded response] with masks."""
    from rl3d.single_controller.batch import DataBatch

    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response_mask = torch.zeros(len(prompts), R, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[row, P - len(prompt) : P] = torch.tensor(prompt)
        ids[row, P : P + len(response)] = torch.tensor(response)
        attention[row, P - len(prompt) : P + len(response)] = 1
        response_mask[row, : len(response)] = 1
    tensors = {"input_ids": ids, "attention_mask": attention, "response_mask": response_mask}
    return DataBatch({**tensors, "responses": ids[:, P:].clone()})


def actor_logprobs(
    groups: Any, hf_dir: str | Path, batch: Any, *, micro_batch_size: int | None = None
) -> Any:
    """Log-probs [B, R] of the batch's responses by rl3d's actor (a MegatronEngine built from
    `hf_dir` in fp32, the actor's forward and vocab-parallel log-probs); None off the last stage."""
    from rl3d.config import ModelConfig
    from rl3d.engine import MegatronEngine
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.spec import spec_of

    model = ModelConfig(hf_path=str(hf_dir), dtype="float32")
    spec = spec_of(model)
    role = MegatronEngine.from_config(spec, groups, role="actor", model=model, seed=1, hf_path=model.hf_path)

    def extract(output: torch.Tensor, micro: Any):
        logits = role.response_slice(output, micro)
        logp, _ = vocab_parallel_logprobs_entropy(
            logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
        )
        return torch.zeros(()), {"logp": logp.detach()}

    outs = role.run_forward(batch, micro_batch_size or len(batch), extract)
    return None if outs is None else torch.cat([o["logp"] for o in outs])


def transformers_logprobs(hf_dir: str | Path, prompts: list[list[int]], responses: list[list[int]]):
    """The same log-probs by transformers (fp32, eager attention), one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    out = torch.zeros(len(prompts), max(map(len, responses)))
    with torch.no_grad():
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            out[row, : len(response)] = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return out


def megatron_tensors(
    hf_dir: str | Path, *, tp: int = 1, tp_rank: int = 0
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The model's spec and its Megatron tensors read from `hf_dir` (TP shard `tp_rank` of `tp`;
    the full tensors at tp 1): the weights the torch rollout engine takes."""
    from types import SimpleNamespace

    from rl3d.models.hf_mapping import tensor_maps
    from rl3d.models.spec import spec_of
    from rl3d.models.weights import HFSource
    from rl3d.parallel.sharding import padded_vocab_size

    spec = spec_of(SimpleNamespace(name=None, hf_path=str(hf_dir)))
    padded = padded_vocab_size(spec.vocab_size, tp)
    source = HFSource(hf_dir, spec, padded)
    try:
        return spec, {m.mcore: source.shard(m.mcore, tp, tp_rank, padded) for m in tensor_maps(spec, padded)}
    finally:
        source.close()
