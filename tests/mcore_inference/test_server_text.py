"""The HTTP server's text handling without a server: incremental detokenization held back at
unfinished UTF-8 characters and at the start of a stop string, chat templates from a model
directory, and engine errors mapped to OpenAI statuses."""

import json
import random

import pytest
import tokenizers
from mcore_inference.server import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    TextAssembler,
    TokenizerAdapter,
    load_chat_template,
)
from mcore_inference.server.errors import from_failed_result
from mcore_models.data import Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer without merges: one token per UTF-8 byte (so "é" is two tokens)."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=_byte_vocab(), merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    return TokenizerAdapter(Tokenizer(backend))


def _byte_vocab():
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    return {symbol: i for i, symbol in enumerate(sorted(alphabet))}


def _pieces(assembler, ids):
    return [assembler.add([token]) for token in ids] + [assembler.finish()]


def test_an_unfinished_utf8_character_is_held_back(byte_tokenizer):
    ids = byte_tokenizer.encode("aé b")
    assert len(ids) == 5  # "é" is two bytes
    pieces = _pieces(TextAssembler(byte_tokenizer), ids)
    assert pieces == ["a", "", "é", " ", "b", ""]
    assert "".join(pieces) == byte_tokenizer.decode(ids)


def test_text_that_may_start_a_stop_string_waits(byte_tokenizer):
    ids = byte_tokenizer.encode("one END two")
    assembler = TextAssembler(byte_tokenizer, ["ENDS", "END"])
    pieces = _pieces(assembler, ids)
    assert "".join(pieces) == "one " == assembler.text
    assert assembler.stopped
    assert pieces[:5] == ["o", "n", "e", " ", ""]  # "E" may start a stop string: held
    assert assembler.kept_tokens() == 4
    # a false start is released once it cannot be a stop string any more
    released = TextAssembler(byte_tokenizer, ["END"])
    assert "".join(_pieces(released, byte_tokenizer.encode("an ENtry"))) == "an ENtry"
    assert not released.stopped


def test_the_first_stop_string_in_the_text_wins(byte_tokenizer):
    assembler = TextAssembler(byte_tokenizer, ["c", "ab"])
    assert "".join(_pieces(assembler, byte_tokenizer.encode("xxabc"))) == "xx"


@pytest.mark.parametrize("seed", range(3))
def test_streamed_pieces_add_up_to_the_whole_decode(byte_tokenizer, seed):
    """Random-sized chunks of multi-byte text: the pieces join to the decode of all the tokens,
    and no piece ends in half a character."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "日本", "🙂", "ß", "\n"]) for _ in range(300))
    ids = byte_tokenizer.encode(text)
    assembler, pieces, start = TextAssembler(byte_tokenizer), [], 0
    while start < len(ids):
        size = rng.randint(1, 5)
        pieces.append(assembler.add(ids[start : start + size]))
        start += size
    pieces.append(assembler.finish())
    assert "".join(pieces) == text == assembler.text
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_a_decoder_that_strips_the_first_space_streams_the_spaces_between_words():
    """SentencePiece-style decoding drops the leading space of the first token only: decoding a
    window of the latest tokens alone would drop each word's space, so the window keeps context."""
    vocab = {"▁Hello": 0, "▁world": 1, ",": 2, "▁again": 3, "<unk>": 4, "</s>": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = TokenizerAdapter(Tokenizer(backend))
    ids = [0, 1, 2, 3, 1, 2, 0]
    pieces = _pieces(TextAssembler(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == "Hello world, again world, Hello"
    assert pieces[:3] == ["Hello", " world", ","]


def test_chat_template_from_the_model_directory(tmp_path):
    assert load_chat_template(tmp_path).source == DEFAULT_CHAT_TEMPLATE  # no tokenizer_config.json
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[user] hi</s>"
    named = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(named))
    assert load_chat_template(tmp_path).render([]) == "y"


def test_default_template_is_chatml():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate().render(messages) == expected


def test_a_template_that_refuses_raises_chat_template_error():
    refusing = ChatTemplate("{{ raise_exception('only user messages') }}")
    with pytest.raises(ChatTemplateError, match="only user messages"):
        refusing.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render([])


@pytest.mark.parametrize(
    ("error", "status", "param"),
    [
        ("InvalidRequestError: prompt: token ids must be in [0, 128)", 400, "prompt"),
        ("InvalidRequestError: temperature: must be 0 (greedy) or ...", 400, "temperature"),
        ("MaxSequenceLengthOverflowError: sequence of 2003 tokens exceeds 1024", 400, "max_tokens"),
        ("EngineLostError: engine e0 was lost (no heartbeat for 5 s) after streaming 3 tokens", 503, None),
        ("CoordinatorError: the engines were stopped", 503, None),
        ("EngineShutdownError: the engine was shut down", 503, None),
        ("RuntimeError: boom", 500, None),
    ],
)
def test_failed_results_map_to_openai_statuses(error, status, param):
    converted = from_failed_result(error)
    assert (converted.status, converted.param) == (status, param)
    assert converted.body()["error"]["message"]
