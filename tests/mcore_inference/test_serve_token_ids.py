"""``return_tokens_as_token_ids`` (vLLM's field) on the live OpenAI server, asked through the
unmodified ``openai`` client's ``extra_body``: the ``token_id:N`` names parse to the in-process
engine's greedy tokens, the log-probabilities, alternatives, offsets and bytes are those of the
same request without the flag, streaming equals the whole answer (completions with echo, chat),
the stop token that ends a choice is in its log-probabilities (as vLLM) but not its text, and a
flag that is not a boolean is a 400 naming it."""

import sys
from pathlib import Path

import httpx
import openai
import pytest
from mcore_inference.server import ChatTemplate

sys.path.insert(0, str(Path(__file__).parent))
from server_stack import API_KEY, MODEL, Stack, write_char_tokenizer

pytestmark = pytest.mark.slow  # the engine processes take seconds to start (torch's import)

AS_IDS = {"extra_body": {"return_tokens_as_token_ids": True}}
FIELD = "return_tokens_as_token_ids"
TOLERANCE = 1e-5  # float32 logits, maybe computed in another batch shape (prefix cache)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    write_char_tokenizer(model_dir)
    stack = Stack(model_dir)
    stack.url, _, _ = stack.serve()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def api(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def token_id(name: str) -> int:
    """The id of a ``token_id:N`` name."""
    prefix, _, number = name.partition(":")
    assert prefix == "token_id" and number.isdigit(), name
    return int(number)


def as_text(stack, name: str) -> str:
    """A ``token_id:N`` name as the text the server names that token by without the flag."""
    return stack.tokenizer.token_text(token_id(name))


def assert_same_completion_logprobs(stack, by_id, by_text):
    """``by_id`` (with the flag) names the tokens of ``by_text`` (without it) by id, with the same
    log-probabilities, alternatives and offsets."""
    assert [as_text(stack, t) for t in by_id.tokens] == by_text.tokens
    assert by_id.token_logprobs == pytest.approx(by_text.token_logprobs, abs=TOLERANCE)
    assert by_id.text_offset == by_text.text_offset
    for mine, theirs in zip(by_id.top_logprobs, by_text.top_logprobs, strict=True):
        if theirs is None:
            assert mine is None
        else:
            assert {as_text(stack, t): p for t, p in mine.items()} == pytest.approx(theirs, abs=TOLERANCE)


def streamed_logprobs(chunks) -> dict[str, list]:
    """The completions ``logprobs`` of a stream's chunks, joined."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in joined.items():
                values += getattr(chunk.choices[0].logprobs, key)
    return joined


def test_completion_token_ids_are_the_engines_tokens(stack, api, expected):
    ids = [40, 41, 42]
    reference = expected.request(ids, 6, logprobs=True, top_n_logprobs=2)
    request = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    by_id, by_text = api.completions.create(**request, **AS_IDS), api.completions.create(**request)
    logprobs = by_id.choices[0].logprobs
    assert [token_id(t) for t in logprobs.tokens] == reference.generated_tokens
    for top, ref in zip(logprobs.top_logprobs, reference.generated_top_logprobs, strict=True):
        assert {token_id(t): p for t, p in top.items()} == pytest.approx(ref, abs=TOLERANCE)
    assert (
        by_id.choices[0].text == by_text.choices[0].text == stack.tokenizer.decode(reference.generated_tokens)
    )
    assert_same_completion_logprobs(stack, logprobs, by_text.choices[0].logprobs)


def test_echo_names_the_prompt_by_id_and_streams_the_same(stack, api, expected):
    ids = [70, 71, 72, 73]
    reference = expected(ids, 5)
    request = dict(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=1, echo=True)
    whole = api.completions.create(**request, **AS_IDS).choices[0]
    assert [token_id(t) for t in whole.logprobs.tokens] == [*ids, *reference]
    assert whole.logprobs.token_logprobs[0] is None and whole.logprobs.top_logprobs[0] is None
    assert_same_completion_logprobs(
        stack, whole.logprobs, api.completions.create(**request).choices[0].logprobs
    )
    chunks = list(api.completions.create(**request, stream=True, **AS_IDS))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = streamed_logprobs(chunks)
    assert streamed["tokens"] == whole.logprobs.tokens
    assert streamed["text_offset"] == whole.logprobs.text_offset
    assert streamed["top_logprobs"][0] is None
    assert streamed["top_logprobs"][1:] == [
        pytest.approx(t, abs=TOLERANCE) for t in whole.logprobs.top_logprobs[1:]
    ]
    assert streamed["token_logprobs"][1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)


def test_chat_token_ids_keep_the_texts_bytes_and_stream_the_same(stack, api, expected):
    messages = [{"role": "user", "content": "ids"}]
    prompt = stack.tokenizer.encode(ChatTemplate().render(messages))
    request = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    by_id = [
        e.model_dump() for e in api.chat.completions.create(**request, **AS_IDS).choices[0].logprobs.content
    ]
    by_text = [e.model_dump() for e in api.chat.completions.create(**request).choices[0].logprobs.content]
    assert [token_id(e["token"]) for e in by_id] == expected(prompt, 5)
    streamed = [
        entry.model_dump()
        for chunk in api.chat.completions.create(**request, stream=True, **AS_IDS)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    for other in (by_text, streamed):
        for mine, theirs in zip(by_id, other, strict=True):
            assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=TOLERANCE)
            assert [t["logprob"] for t in mine["top_logprobs"]] == pytest.approx(
                [t["logprob"] for t in theirs["top_logprobs"]], abs=TOLERANCE
            )
    for mine, theirs in zip(by_id, by_text, strict=True):  # the names change, the bytes do not
        assert (as_text(stack, mine["token"]), mine["bytes"]) == (theirs["token"], theirs["bytes"])
        alternatives = [(as_text(stack, t["token"]), t["bytes"]) for t in mine["top_logprobs"]]
        assert alternatives == [(t["token"], t["bytes"]) for t in theirs["top_logprobs"]]
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in by_id]


def test_the_stop_token_is_in_the_logprobs_not_the_text(stack, api, expected):
    """As vLLM: a choice that a stop token (or EOS) ends lists it last in its log-probabilities."""
    ids = [50, 51, 52]
    reference = expected.request(ids, 12, logprobs=True, top_n_logprobs=1)
    tokens = reference.generated_tokens
    end = tokens.index(tokens[4]) + 1  # up to the first occurrence of the stop token
    request = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=1)
    body = {"return_tokens_as_token_ids": True, "stop_token_ids": [tokens[4]]}
    whole = api.completions.create(**request, extra_body=body).choices[0]
    assert (whole.text, whole.finish_reason) == (stack.tokenizer.decode(tokens[: end - 1]), "stop")
    assert [token_id(t) for t in whole.logprobs.tokens] == tokens[:end]
    assert whole.logprobs.token_logprobs == pytest.approx(reference.generated_logprobs[:end], abs=TOLERANCE)
    assert whole.logprobs.text_offset[-1] == len(whole.text)
    chunks = list(api.completions.create(**request, stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert streamed_logprobs(chunks)["tokens"] == whole.logprobs.tokens
    assert streamed_logprobs(chunks)["text_offset"] == whole.logprobs.text_offset


@pytest.mark.parametrize("value", ["yes", 1, [True]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_flag_that_is_not_a_boolean_is_a_400_naming_it(stack, path, value):
    body = {"model": MODEL, "max_tokens": 2, "logprobs": True, FIELD: value}
    body |= (
        {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x", "logprobs": 0}
    )
    response = httpx.post(f"{stack.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (FIELD, "invalid_request_error")
    assert FIELD in error["message"] and "boolean" in error["message"]
