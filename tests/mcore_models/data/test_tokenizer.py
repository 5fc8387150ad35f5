"""The BPE tokenizer: training, round trips, special ids, the cache, and loading tokenizer.json."""

import pytest
import tokenizers
from mcore_models.data import tokenizer as tokenizer_module
from mcore_models.data.tokenizer import SPECIAL_TOKENS, Tokenizer, default_tokenizer, train_bpe_tokenizer
from tokenizers import models, pre_tokenizers


def test_special_ids_come_first_and_are_named(small_tokenizer):
    tok = small_tokenizer
    assert [tok.token_to_id(token) for token in SPECIAL_TOKENS] == list(range(6))
    assert (tok.eod_id, tok.pad_id) == (0, 1)
    assert (tok.fim_prefix_id, tok.fim_middle_id, tok.fim_suffix_id, tok.fim_pad_id) == (2, 3, 4, 5)
    assert tok.special_tokens == {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    assert tok.vocab_size == 600


def test_round_trip_of_arbitrary_text_and_special_tokens(small_tokenizer):
    text = "def f(x):\n    return x ** 2  # café ☃ \t\n"
    ids = small_tokenizer.encode(text)
    assert small_tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges learned on Python code compress it
    with_eod = small_tokenizer.encode("a<|endoftext|>b")
    assert small_tokenizer.eod_id in with_eod
    assert small_tokenizer.decode(with_eod) == "a<|endoftext|>b"
    assert small_tokenizer.encode_batch(["x = 1", text]) == [small_tokenizer.encode("x = 1"), ids]


def test_save_and_load_give_the_same_ids(small_tokenizer, tmp_path):
    small_tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    loaded = Tokenizer.from_file(tmp_path / "tok" / "tokenizer.json")
    text = "import os\nprint(os.getcwd())\n"
    assert loaded.encode(text) == small_tokenizer.encode(text)
    assert (loaded.eod_id, loaded.pad_id, loaded.fim_middle_id) == (0, 1, 3)


def test_vocab_smaller_than_bytes_and_specials_is_rejected():
    with pytest.raises(ValueError, match="vocab_size must be at least 262"):
        train_bpe_tokenizer(["x"], vocab_size=100)


def test_default_tokenizer_is_trained_once_then_loaded_from_cache(tmp_path, monkeypatch):
    first = default_tokenizer(vocab_size=300, cache_dir=tmp_path)
    cached = list((tmp_path / "tokenizers").glob("py3.*-v300-*.json"))
    assert len(cached) == 1

    def refuse_to_train(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", refuse_to_train)
    second = default_tokenizer(vocab_size=300, cache_dir=tmp_path)
    text = "for i in range(10):\n    pass\n"
    assert second.encode(text) == first.encode(text) and second.vocab_size == 300


def _word_level_tokenizer(path, vocab):
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([token for token in vocab if token.startswith("<")])
    backend.save(str(path))
    return path


def test_loaded_tokenizer_without_pad_pads_with_eod(tmp_path):
    path = _word_level_tokenizer(tmp_path / "tokenizer.json", {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3})
    tok = Tokenizer.from_file(path)
    assert tok.encode("hello world") == [2, 3]
    assert (tok.eod_id, tok.pad_id) == (1, 1)
    assert tok.fim_prefix_id is None and tok.fim_pad_id is None
    assert Tokenizer.from_file(path, eod_token="<unk>").eod_id == 0


def test_loaded_tokenizer_without_eod_or_named_pad_is_an_error(tmp_path):
    path = _word_level_tokenizer(tmp_path / "tokenizer.json", {"<unk>": 0, "hello": 1})
    with pytest.raises(ValueError, match="eod_token: the vocabulary has no token any of"):
        Tokenizer.from_file(path)
    with pytest.raises(ValueError, match="pad_token: the vocabulary has no token '<pad>'"):
        Tokenizer.from_file(path, eod_token="<unk>", pad_token="<pad>")
