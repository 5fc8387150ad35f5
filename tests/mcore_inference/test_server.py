"""The OpenAI-compatible HTTP server, live over loopback, queried with the unmodified ``openai``
client (and ``httpx`` for raw bodies): a coordinator with two engine processes serving the
conftest's tiny model, outputs compared with the in-process engine's (greedy, seeded, logprobs,
penalties), streaming, stop strings, every error status with its OpenAI body, metrics, health,
tokenization, the API key, client disconnects and the SIGTERM drain."""

import asyncio
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from mcore_inference.server import ChatTemplate

sys.path.insert(0, str(Path(__file__).parent))
from metrics_scrape import scrape
from server_stack import API_KEY, MAX_MODEL_LEN, MODEL, Stack, write_char_tokenizer

pytestmark = pytest.mark.slow  # the engine processes take seconds to start (torch's import)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    write_char_tokenizer(model_dir)
    stack = Stack(model_dir)
    stack.url, stack.server, _ = stack.serve(max_body_bytes=64 << 10)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def api(stack):
    """The ``openai`` client of the module's server."""
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def text(stack, tokens):
    return stack.tokenizer.decode(tokens)


def post(url, path, body, headers=AUTH, **kwargs):
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def assert_error(response, status, param=None, code=None):
    """``response`` has ``status`` and an OpenAI error body naming ``param``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_completions_equal_the_in_process_engine(stack, api, expected):
    prompts = ["def fib(n):", "import os\n", "Hello"]
    expected.prime([stack.tokenizer.encode(p) for p in prompts], 8)
    response = api.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, response.choices, strict=True):
        assert choice.text == text(stack, expected(stack.tokenizer.encode(prompt), 8))
        assert choice.finish_reason == "length"
    lengths = sum(len(stack.tokenizer.encode(p)) for p in prompts)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (lengths, 24)
    assert response.usage.total_tokens == lengths + 24
    # token ids as the prompt, and echo
    ids = [5, 17, 29, 41]
    echoed = api.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == text(stack, ids) + text(stack, expected(ids, 6))


def test_chat_uses_the_template_and_equals_the_engine(stack, api, expected):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = stack.tokenizer.encode(ChatTemplate().render(messages))
    response = api.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=7, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == text(stack, expected(prompt, 7))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 7)
    tokenized = post(stack.url, "/tokenize", {"messages": messages}).json()
    assert tokenized["tokens"] == prompt
    # content as text parts is the same text
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
    ]
    same = api.chat.completions.create(model=MODEL, messages=parts, max_tokens=7, temperature=0)
    assert same.choices[0].message.content == choice.message.content
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert_error(post(stack.url, "/v1/chat/completions", {"messages": image}), 400, "messages")


def test_streaming_with_usage(stack, api, expected):
    ids = [3, 1, 4, 1, 5]
    chunks = list(
        api.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text(stack, expected(ids, 10))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 5
    messages = [{"role": "user", "content": "stream"}]
    prompt = stack.tokenizer.encode(ChatTemplate().render(messages))
    chat = list(
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0, stream=True)
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == text(stack, expected(prompt, 9))
    assert chat[-1].choices[0].finish_reason == "length"
    raw = post(stack.url, "/v1/completions", {"prompt": ids, "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_n_and_seed_reproduce_the_engine(stack, api, expected):
    ids = [9, 8, 7, 6]
    sampling = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    first = api.completions.create(model=MODEL, prompt=ids, max_tokens=8, n=3, seed=11, **extra(sampling))
    again = api.completions.create(model=MODEL, prompt=ids, max_tokens=8, n=3, seed=11, **extra(sampling))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    for i, choice_text in enumerate(texts):  # choice i is seeded with seed + i
        assert choice_text == text(stack, expected(ids, 8, seed=11 + i, **sampling))
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == 4


def test_streamed_choices_interleave_and_each_is_whole(stack, api, expected):
    ids = [9, 8, 7, 6]
    sampling = dict(temperature=0.8, top_k=20)
    chunks = list(
        api.completions.create(
            model=MODEL, prompt=[ids, [5, 5]], max_tokens=6, n=2, seed=4, stream=True, **extra(sampling),
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts, reasons = ["", "", "", ""], [None] * 4
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    for index, (prompt, i) in enumerate([(ids, 0), (ids, 1), ([5, 5], 0), ([5, 5], 1)]):
        assert texts[index] == text(stack, expected(prompt, 6, seed=4 + i, **sampling))
    assert reasons == ["length"] * 4
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 24)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, n=2, seed=4, temperature=0.8
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10


def test_concurrent_streams_lose_and_duplicate_nothing(stack, prompts_factory, expected):
    """32 streamed requests, 16 at a time, over the two engines: every stream's text equals the
    in-process engine's greedy output, each answered exactly once."""
    prompts = prompts_factory(32, 3, 12, seed=7)
    expected.prime(prompts, 8)
    api = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    gate = asyncio.Semaphore(16)

    async def one(prompt):
        async with gate:
            stream = await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
            chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks), [c.choices[0].finish_reason for c in chunks]

    async def run_all():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await api.close()

    results = asyncio.run(run_all())
    for prompt, (streamed, reasons) in zip(prompts, results, strict=True):
        assert streamed == text(stack, expected(prompt, 8))
        assert [r for r in reasons if r] == ["length"]


def extra(sampling):
    """Sampling fields the ``openai`` client has no argument for go in ``extra_body``."""
    known = {"temperature", "top_p", "presence_penalty", "frequency_penalty"}
    body = {k: v for k, v in sampling.items() if k not in known}
    return {**{k: v for k, v in sampling.items() if k in known}, "extra_body": body}


def test_penalties_reach_the_engine(stack, api, expected):
    ids = [1, 2, 1, 2, 1, 2]
    sampling = dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    response = api.completions.create(model=MODEL, prompt=ids, max_tokens=12, **extra(sampling))
    assert response.choices[0].text == text(stack, expected(ids, 12, **sampling))
    assert response.choices[0].text != text(stack, expected(ids, 12))


def test_logprobs_equal_the_engine(stack, api, expected):
    ids = [40, 41, 42]
    reference = expected.request(ids, 5, logprobs=True, top_n_logprobs=2)
    response = api.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [text(stack, [t]) for t in reference.generated_tokens]
    assert logprobs.token_logprobs == pytest.approx(reference.generated_logprobs, abs=1e-5)
    for top, ref in zip(logprobs.top_logprobs, reference.generated_top_logprobs, strict=True):
        assert top == pytest.approx({text(stack, [t]): p for t, p in ref.items()}, abs=1e-5)
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-6)


def _echo_reference(stack, expected, ids, n):
    """The in-process engine's prompt and output log-probabilities of ``ids``, as the completions
    ``logprobs`` of an echo with ``logprobs=2`` lists them."""
    reference = expected.request(ids, n, logprobs=True, top_n_logprobs=2, prompt_logprobs=True)
    tokens = [*ids, *reference.generated_tokens]
    logprobs = reference.prompt_logprobs + reference.generated_logprobs
    tops = [None] + [
        {text(stack, [t]): p for t, p in top.items()}
        for top in reference.prompt_top_logprobs[1:] + reference.generated_top_logprobs
    ]
    return tokens, logprobs, tops


def _assert_logprobs(logprobs, reference_logprobs, reference_tops):
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(reference_logprobs[1:], abs=1e-5)
    for top, ref in zip(logprobs.top_logprobs[1:], reference_tops[1:], strict=True):
        assert top == pytest.approx(ref, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_as_the_engine(stack, api, expected):
    ids = [40, 41, 42, 43, 44]
    tokens, reference_logprobs, reference_tops = _echo_reference(stack, expected, ids, 4)
    response = api.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text == text(stack, tokens)
    assert choice.logprobs.tokens == [text(stack, [t]) for t in tokens]
    assert choice.logprobs.text_offset == list(range(len(tokens)))  # one character a token
    _assert_logprobs(choice.logprobs, reference_logprobs, reference_tops)
    streamed = list(
        api.completions.create(
            model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert parts[0].tokens == [text(stack, [t]) for t in ids]  # the echo comes first, with the prompt's
    joined = {
        field: [x for p in parts for x in getattr(p, field)]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert joined["tokens"] == choice.logprobs.tokens and joined["text_offset"] == choice.logprobs.text_offset
    assert joined["top_logprobs"] == choice.logprobs.top_logprobs
    assert joined["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:])


def test_echo_with_no_tokens_to_generate_scores_the_prompt(stack, api, expected):
    ids = [7, 8, 9, 10, 11, 12]
    _, reference_logprobs, _ = _echo_reference(stack, expected, ids, 1)
    for stream in (False, True):
        chunks = api.completions.create(
            model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )  # fmt: skip
        if stream:
            chunks = list(chunks)
            choices = [c.choices[0] for c in chunks if c.choices]
            text_ = "".join(c.text for c in choices)
            logprobs = next(c.logprobs for c in choices if c.logprobs is not None)
            finish, usage = choices[-1].finish_reason, chunks[-1].usage
        else:
            text_, logprobs = chunks.choices[0].text, chunks.choices[0].logprobs
            finish, usage = chunks.choices[0].finish_reason, chunks.usage
        assert text_ == text(stack, ids) and finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 0)
        assert logprobs.tokens == [text(stack, [t]) for t in ids] and logprobs.top_logprobs is None
        assert logprobs.token_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(reference_logprobs[1 : len(ids)], abs=1e-5)


def test_streamed_logprobs_equal_the_engine(stack, api, expected):
    ids = [40, 41, 42]
    reference = expected.request(ids, 5, logprobs=True, top_n_logprobs=2)
    chunks = list(
        api.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2, stream=True)
    )
    tokens, logprobs, tops, offsets = [], [], [], []
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            tops += chunk.choices[0].logprobs.top_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == [text(stack, [t]) for t in reference.generated_tokens]
    assert logprobs == pytest.approx(reference.generated_logprobs, abs=1e-5)
    for top, ref in zip(tops, reference.generated_top_logprobs, strict=True):
        assert top == pytest.approx({text(stack, [t]): p for t, p in ref.items()}, abs=1e-5)
    assert offsets == list(range(5))  # one character a token
    messages = [{"role": "user", "content": "x"}]
    chat = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    content = [
        entry
        for chunk in chat
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    whole = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    # The same tokens, and log-probabilities up to float32 rounding: the second request may find the
    # prompt in the prefix cache and compute its logits in another batch shape.
    streamed, complete = (
        [e.model_dump() for e in content],
        [e.model_dump() for e in whole.choices[0].logprobs.content],
    )
    assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in complete]
    for mine, theirs in zip(streamed, complete, strict=True):
        assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-5)
        assert [(t["token"], t["bytes"]) for t in mine["top_logprobs"]] == [
            (t["token"], t["bytes"]) for t in theirs["top_logprobs"]
        ]
        assert [t["logprob"] for t in mine["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in theirs["top_logprobs"]], abs=1e-5
        )


def test_stop_strings_and_stop_token_ids(stack, api, expected):
    ids = [70, 71, 72]
    full = text(stack, expected(ids, 24))
    stop = full[6:8]
    cut = full.find(stop)
    response = api.completions.create(
        model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    assert (response.choices[0].text, response.choices[0].finish_reason) == (full[:cut], "stop")
    stream = api.completions.create(
        model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    tokens = expected(ids, 24)
    stop_id = tokens[4]
    by_id = api.completions.create(
        model=MODEL, prompt=ids, max_tokens=24, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert by_id.choices[0].text == text(stack, tokens[: tokens.index(stop_id)])
    assert by_id.choices[0].finish_reason == "stop"


ERROR_CASES = [
    # (path, body, status, param, code)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 1000}, 400, "top_k", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 2}, 400, "min_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [500]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools", None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERROR_CASES)
def test_bad_requests_get_openai_errors(stack, path, body, status, param, code):
    assert_error(post(stack.url, path, body), status, param, code)


def test_malformed_unauthorized_unknown_and_too_large(stack, api, expected):
    url = stack.url
    malformed = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert_error(malformed, 400)
    assert_error(post(url, "/v1/completions", ["a", "list"]), 400)
    assert_error(post(url, "/v1/completions", {"prompt": "x"}, headers={}), 401, code="invalid_api_key")
    wrong = post(url, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401, code="invalid_api_key")
    assert_error(httpx.get(f"{url}/v1/nowhere", headers=AUTH), 404, code="not_found")
    assert_error(post(url, "/v1/completions", {"prompt": "x" * (100 << 10)}), 413, code="too_large")
    chunked = httpx.post(  # no Content-Length: counted as it arrives
        f"{url}/v1/completions",
        content=iter([b"{" + b" " * (40 << 10), b" " * (40 << 10) + b"}"]),
        headers=AUTH,
    )
    assert_error(chunked, 413, code="too_large")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="x")
    # the server keeps serving everyone else
    response = api.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert response.choices[0].text == text(stack, expected([1, 2, 3], 4))


def test_a_request_longer_than_the_engines_context_is_a_400(stack):
    """A server told a longer context than the engines have: the engines refuse, the server says
    which field."""
    url, _, _ = stack.serve(max_model_len=4 * MAX_MODEL_LEN)
    response = post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2000})
    assert_error(response, 400, "max_tokens", "context_length_exceeded")


def test_models_and_tokenize(stack, api):
    assert [m.id for m in api.models.list().data] == [MODEL]
    tokens = post(stack.url, "/tokenize", {"prompt": "Hi there"}).json()
    assert tokens == {"tokens": [ord(c) for c in "Hi there"], "count": 8, "max_model_len": MAX_MODEL_LEN}
    back = post(stack.url, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": "Hi there"}
    assert_error(post(stack.url, "/detokenize", {"tokens": [1, 500]}), 400, "tokens")
    assert_error(post(stack.url, "/tokenize", {}), 400, "prompt")


def test_metrics_count_what_was_sent(stack, api):
    before = scrape(stack.url)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for prompt in prompts:
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    api.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, n=2, temperature=0)
    assert_error(post(stack.url, "/v1/completions", {"prompt": "x", "top_p": 0}), 400, "top_p")
    after = scrape(stack.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("mcore_requests_total", outcome="length") == 5
    assert delta("mcore_prompt_tokens_total") == 3 + 4 + 2 + 2 * 2
    assert delta("mcore_generation_tokens_total") == 3 * 5 + 2 * 3
    assert delta("mcore_time_to_first_token_seconds_count") == 5
    assert delta("mcore_e2e_request_latency_seconds_count") == 5
    assert delta("mcore_inter_token_latency_seconds_count") == 3 * 4 + 2 * 2
    assert delta("mcore_http_requests_rejected_total", status="400") == 1
    assert after[("mcore_engines_live", ())] == 2
    assert after[("mcore_requests_running", ())] == 0 and after[("mcore_requests_waiting", ())] == 0


def _settled(url: str, quiet: float = 1.5, timeout: float = 15.0) -> dict:
    """The metrics once no request holds a cache block and the prefix-cache counters have not
    moved for ``quiet`` seconds (several engine heartbeats)."""
    deadline = time.monotonic() + timeout
    last, since = scrape(url), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = scrape(url)
        key = ("mcore_prefix_cache_queried_tokens", ())
        if now[key] != last[key] or now[("mcore_kv_cache_usage_ratio", ())] != 0.0:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    return last


def test_metrics_report_the_engines_caches(stack, api):
    """Round robin over two engines: a 41-token prompt sent four times meets each engine twice,
    and the second time 40 of its tokens (10 blocks of 4; the last token is always computed)
    come from that engine's prefix cache."""
    prompt = list(range(50, 91))
    before = _settled(stack.url)  # earlier tests' requests reach the counters with later heartbeats
    for _ in range(4):
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    while True:  # the engines report with their heartbeats
        after = scrape(stack.url)
        queried = (
            after[("mcore_prefix_cache_queried_tokens", ())]
            - before[("mcore_prefix_cache_queried_tokens", ())]
        )
        idle = after[("mcore_kv_cache_usage_ratio", ())] == 0.0  # the last request's blocks freed
        if (queried >= 4 * 41 and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert queried == 4 * 41
    hits = after[("mcore_prefix_cache_hit_tokens", ())] - before[("mcore_prefix_cache_hit_tokens", ())]
    assert hits == 2 * 40
    rate = after[("mcore_prefix_cache_hit_tokens", ())] / after[("mcore_prefix_cache_queried_tokens", ())]
    assert after[("mcore_prefix_cache_hit_rate", ())] == pytest.approx(rate)
    assert after[("mcore_kv_cache_usage_ratio", ())] == 0.0  # idle: no request holds a block


def test_health_states(stack, tmp_path):
    url = stack.url
    ok = httpx.get(f"{url}/health", timeout=30)
    assert ok.status_code == 200 and ok.json()["engines"] == 2
    assert httpx.get(f"{url}/v1/health", timeout=30).status_code == 200

    stack.control("pause")
    try:
        assert "paused" in assert_error(httpx.get(f"{url}/health", timeout=30), 503)["message"]
    finally:
        stack.control("unpause")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    # a coordinator with no engine yet (loading), and one that does not answer
    from mcore_inference import InferenceCoordinator

    with InferenceCoordinator() as empty:
        lonely, _, _ = stack.serve(empty.address)
        assert "no live engine" in assert_error(httpx.get(f"{lonely}/health", timeout=30), 503)["message"]
    gone, _, _ = stack.serve("tcp://127.0.0.1:1", timeout=0.5, health_timeout=2.0)
    assert "does not answer" in assert_error(httpx.get(f"{gone}/health", timeout=30), 503)["message"]
    refused = post(gone, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert "coordinator" in assert_error(refused, 503, code="service_unavailable")["message"]


def _send_raw(url, body):
    """A socket that sent ``POST /v1/completions`` with ``body`` (the answer left unread)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + data)
    return sock


def _wait_requests(stack, count, timeout=30):
    """Wait until the coordinator has ``count`` unfinished requests (``TimeoutError`` after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while stack.status().requests != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {count} unfinished requests after {timeout} s")
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request(stack, stream):
    """While the engines are paused a request can only end by an abort: closing the connection
    must end it at the engine (the coordinator then has nothing unfinished)."""
    before = scrape(stack.url)
    stack.control("pause")
    try:
        sock = _send_raw(stack.url, {"prompt": [1, 2, 3], "max_tokens": 50, "stream": stream})
        _wait_requests(stack, 1)
        sock.close()
        _wait_requests(stack, 0)
    finally:
        stack.control("unpause")
    after = scrape(stack.url)
    key = ("mcore_requests_total", (("outcome", "abort"),))
    assert after[key] - before.get(key, 0) == 1


def test_concurrency_bound_answers_429(stack, expected):
    url, _, _ = stack.serve(max_concurrency=1)
    stack.control("pause")  # the first request waits, admitted, until the engines step again
    try:
        first = {}
        waiting = threading.Thread(
            target=lambda: first.update(
                r=post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "temperature": 0})
            )
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while stack.status().requests == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        second = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert_error(second, 429, code="too_many_requests")
    finally:
        stack.control("unpause")
    waiting.join(30)
    assert first["r"].json()["choices"][0]["text"] == text(stack, expected([1, 2], 3))
    assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def _in_flight(stack, url, body):
    """Post ``body`` from a thread while the engines are paused, once it is at the coordinator;
    ``(thread, answer)`` where ``answer["r"]`` will be the response (or ``answer["error"]``)."""
    answer = {}

    def send():
        try:
            answer["r"] = post(url, "/v1/completions", body)
        except httpx.HTTPError as error:
            answer["error"] = error

    thread = threading.Thread(target=send)
    thread.start()
    _wait_requests(stack, 1)
    return thread, answer


def test_sigterm_drains_in_flight_requests(stack, expected):
    url, server, thread = stack.serve(graceful_timeout=30.0)
    stack.control("pause")
    try:
        waiting, answer = _in_flight(stack, url, {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0})
        server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.1)
        assert "shutting down" in assert_error(post(url, "/v1/completions", {"prompt": "x"}), 503)["message"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
    finally:
        stack.control("unpause")
    waiting.join(30)
    assert answer["r"].json()["choices"][0]["text"] == text(stack, expected([1, 2, 3], 6))
    thread.join(15)
    assert not thread.is_alive()  # the server stopped once the request was done


def test_sigterm_aborts_what_outlives_the_grace_period(stack):
    url, server, thread = stack.serve(graceful_timeout=0.3)
    stack.control("pause")
    try:
        waiting, answer = _in_flight(stack, url, {"prompt": [1, 2, 3], "max_tokens": 6})
        server.handle_exit(signal.SIGTERM, None)
        thread.join(15)
        assert not thread.is_alive()  # stopped after the grace period, the request unfinished
        _wait_requests(stack, 0)  # still paused: only an abort ends it
    finally:
        stack.control("unpause")
    waiting.join(30)
    assert "error" in answer or answer["r"].status_code >= 500
