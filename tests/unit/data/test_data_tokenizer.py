import pytest

from rl3d.data import EOS_ID, PAD_ID, SYMBOL_BASE, SyntheticTokenizer, load_tokenizer


def test_synthetic_tokenizer_round_trip_and_special_ids():
    tok = SyntheticTokenizer(256)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, None)
    assert (PAD_ID, EOS_ID) == (0, 1) and SYMBOL_BASE > EOS_ID
    assert tok.decode([17, 3, 255]) == "17 3 255"
    assert tok.encode("17 3  255\n") == [17, 3, 255]
    assert tok.encode(tok.decode([0, 1, 42])) == [0, 1, 42]
    assert tok.decode([20, EOS_ID, PAD_ID], skip_special_tokens=True) == "20"
    assert tok.batch_decode([[16], [17, 18]]) == ["16", "17 18"]
    assert len(tok) == 256


def test_synthetic_tokenizer_rejects_out_of_vocabulary():
    tok = SyntheticTokenizer(32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([32])
    with pytest.raises(ValueError, match="not a token id"):
        tok.encode("17 x")
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticTokenizer(4)


def test_load_tokenizer_without_path_is_synthetic():
    tok = load_tokenizer(None, vocab_size=128)
    assert isinstance(tok, SyntheticTokenizer) and len(tok) == 128


def test_load_tokenizer_from_local_directory(wordlevel_dir, word_id):
    tok = load_tokenizer(str(wordlevel_dir), vocab_size=256)
    ids = tok.encode("what is two plus three ?")
    assert ids == [word_id(w) for w in ["what", "is", "two", "plus", "three", "?"]]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    assert tok.decode(ids) == "what is two plus three ?"


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope.*not a directory"):
        load_tokenizer(str(missing), vocab_size=256)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"tokenizer '{empty}': cannot load"):
        load_tokenizer(str(empty), vocab_size=256)


def test_load_tokenizer_sets_pad_to_eos_when_missing(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path
    )
    loaded = load_tokenizer(str(tmp_path), vocab_size=256)
    assert loaded.pad_token_id == loaded.eos_token_id == 1
