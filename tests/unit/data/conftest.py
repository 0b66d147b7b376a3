"""A real HF tokenizer built offline: a whitespace WordLevel vocabulary, saved and reloaded."""

from __future__ import annotations

import pytest

WORDS = ["Q:", "what", "is", "two", "plus", "three", "?", "(", ")", "math", "word", "#"]


@pytest.fixture(scope="session")
def wordlevel_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("wordlevel_tokenizer")
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def wordlevel(wordlevel_dir):
    from rl3d.data import load_tokenizer

    return load_tokenizer(str(wordlevel_dir), vocab_size=256)


@pytest.fixture(scope="session")
def word_id():
    """The id the WordLevel tokenizer gives a word."""
    return lambda word: WORDS.index(word) + 3
