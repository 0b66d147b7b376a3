"""Chat-format test inputs made offline: a small HF tokenizer with a chat template, and parquet
files in verl's RL layout.

The tokenizer is a whitespace WordLevel vocabulary with ChatML's `<|im_start|>` / `<|im_end|>`
as special tokens and SmolLM2-Instruct's chat template (a default system prompt when the
conversation has none), so it frames prompts as that model's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIALS = ("[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>")  # ids 0..3; <|im_end|> is EOS
EOS_ID = 3
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (
    "system",
    "user",
    "assistant",
    *DEFAULT_SYSTEM.split(),
    "what",
    "is",
    "two",
    "plus",
    "three",
    "?",
    "####",
)


def save_chat_tokenizer(directory: str | Path, words: Sequence[str] = WORDS) -> Path:
    """A tokenizer directory (`data.tokenizer`) whose vocabulary is SPECIALS, then `words`, then
    the digits 0-9; `<|im_end|>` is its EOS and pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIALS, *words, *"0123456789"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|im_end|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(directory))
    return Path(directory)


def verl_row(question: str, answer: str, index: int, *, source: str = "openai/gsm8k") -> dict[str, Any]:
    """One row as verl's GSM8K preprocessing writes it."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "question": question, "answer": answer},
    }


def write_verl_parquet(path: str | Path, rows: Sequence[dict[str, Any]], *, row_group_size: int = 2) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), str(path), row_group_size=row_group_size)
    return str(path)
