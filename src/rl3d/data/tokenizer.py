"""Tokenizers: an HF tokenizer from a local directory, or the synthetic id-is-token vocabulary.

`SyntheticTokenizer` serves the synthetic tasks (`rl3d.data.synthetic`), where a token *is* its
id: ``decode([5, 17]) == "5 17"`` and ``encode("5 17") == [5, 17]``. Reserved ids:

    PAD_ID = 0   padding (never produced by a synthetic task)
    EOS_ID = 1   end of sequence (a stop token for the rollout engine, if a recipe wants one)

Ids 2 .. SYMBOL_BASE-1 are unused; synthetic tasks draw prompt symbols from SYMBOL_BASE up, so
prompts never contain a special id. There is no BOS token and `encode` adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rl3d.utils.imports import import_object, is_import_path

PAD_ID = 0
EOS_ID = 1
SYMBOL_BASE = 16  # first id a synthetic task may use in a prompt


class SyntheticTokenizer:
    """A vocabulary of `vocab_size` ids whose text form is the decimal id."""

    pad_token_id = PAD_ID
    eos_token_id = EOS_ID
    bos_token_id = None

    def __init__(self, vocab_size: int):
        if vocab_size <= SYMBOL_BASE:
            raise ValueError(f"SyntheticTokenizer: vocab_size must be > {SYMBOL_BASE}, got {vocab_size}")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Inverse of `decode`; `add_special_tokens` is accepted for HF compatibility (no-op)."""
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(f"SyntheticTokenizer: {word!r} is not a token id") from None
            self._check(token)
            ids.append(token)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        tokens = [int(i) for i in ids]
        for token in tokens:
            self._check(token)
        if skip_special_tokens:
            tokens = [t for t in tokens if t not in (PAD_ID, EOS_ID)]
        return " ".join(str(t) for t in tokens)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def _check(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"SyntheticTokenizer: id {token} outside the vocabulary [0, {self.vocab_size})")

    def __repr__(self) -> str:
        return f"SyntheticTokenizer(vocab_size={self.vocab_size})"


def tokenizer_path(data: Any, model_path: str | None) -> str | None:
    """A run's tokenizer from its `data` section (`rl3d.config.DataConfig`, not imported: the
    config layer sits above data) and `model.hf_path`: `data.tokenizer`, else the model's
    directory for text data; None: the synthetic vocabulary (synthetic tasks speak token ids)."""
    return data.tokenizer or (model_path if data.train_files else None)


def load_tokenizer(path: str | None, *, vocab_size: int) -> Any:
    """An HF tokenizer from the local directory `path`, a class named ``"package.module:Class"``
    built with `vocab_size`, or a `SyntheticTokenizer(vocab_size)`.

    Nothing is downloaded (`local_files_only=True`). A tokenizer without a pad token gets its
    EOS token as pad, the usual choice for decoder-only models.
    """
    if path is None:
        return SyntheticTokenizer(vocab_size)
    if is_import_path(path):  # a tokenizer class of a synthetic task, e.g. rl3d.data.tool_task:ToolTokenizer
        return import_object(path, what="tokenizer")(vocab_size)
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(f"tokenizer {path!r}: not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise ValueError(f"tokenizer {path!r}: cannot load a tokenizer from it: {err}") from err
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pad_id_of(tokenizer: Any) -> int:
    """The id that pads a batch: the tokenizer's pad token, else 0 (a tokenizer without one; the
    attention masks keep pads out of every forward, so only the id's range matters)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else pad
