"""``mcore-serve`` under load, as a subprocess over loopback: 64 concurrent streaming clients (tasks
sharing one unmodified ``openai.AsyncOpenAI``, a connection each) send 400 greedy completions (mixed
prompt lengths and ``max_tokens``) to 2 data-parallel engines. Every request is answered exactly once, and every stream's text equals
the non-streamed answer to the same request (the character tokenizer maps one token to one
character, so equal text is an equal token sequence: none lost, none duplicated)."""

import asyncio
import random
import string
import sys
import time
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from metrics_scrape import scrape
from serve_process import serve_tiny_model, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # mcore-serve imports torch, starts engines

MODEL = "tiny-llama"
CLIENTS = 64
REQUESTS = 400
DISTINCT = 100  # each sent 4 times: repeats meet both engines and their prefix caches
TIME_LIMIT = 180  # seconds for the 400 streams: generous, a hang fails rather than a slow machine


@pytest.fixture
def url(tmp_path):
    """The URL of an ``mcore-serve`` with 2 engines serving the tiny model; stopped after the test."""
    process, url = serve_tiny_model(tmp_path)
    yield url
    returncode, output = stop_serve(process)
    assert returncode == 0, output


def requests(seed: int = 0) -> list[tuple[str, int]]:
    """``DISTINCT`` (prompt, max_tokens) pairs: printable prompts of 1-64 characters, 1-16 tokens."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    return [
        ("".join(rng.choices(alphabet, k=rng.randint(1, 64))), rng.randint(1, 16)) for _ in range(DISTINCT)
    ]


async def whole(api, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """The non-streamed answer: ``(text, finish_reason, completion_tokens)``."""
    response = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    (choice,) = response.choices
    return choice.text, choice.finish_reason, response.usage.completion_tokens


async def streamed(api, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """The streamed answer, checked to carry exactly one finish reason and one usage chunk."""
    stream = await api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(reasons) == 1 and len(usages) == 1 and chunks[-1].choices == [], chunks
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, reasons[0], usages[0].completion_tokens


async def load(url: str, pairs: list[tuple[str, int]]) -> tuple[list, dict[int, tuple], float]:
    """The non-streamed answers to ``pairs``, then ``REQUESTS`` streams by ``CLIENTS`` concurrent
    clients taking request numbers from one queue; ``(answers, {number: stream}, seconds)``."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIME_LIMIT)
    try:
        answers = await asyncio.gather(*(whole(api, *pair) for pair in pairs))
        queue: asyncio.Queue = asyncio.Queue()
        for number in range(REQUESTS):
            queue.put_nowait(number)
        streams: dict[int, tuple] = {}

        async def client():
            while not queue.empty():
                number = queue.get_nowait()
                result = await streamed(api, *pairs[number % len(pairs)])
                assert number not in streams
                streams[number] = result

        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(CLIENTS))), TIME_LIMIT)
        return answers, streams, time.monotonic() - started
    finally:
        await api.close()


def test_64_streaming_clients_lose_and_duplicate_nothing(url):
    pairs = requests()
    before = scrape(url)
    answers, streams, seconds = asyncio.run(load(url, pairs))
    after = scrape(url)
    assert sorted(streams) == list(range(REQUESTS)), "a request was not answered"
    for number, (text, reason, tokens) in streams.items():
        assert (text, reason, tokens) == answers[number % DISTINCT], number
    for (prompt, max_tokens), (text, reason, tokens) in zip(pairs, answers, strict=True):
        assert reason in ("length", "stop") and tokens <= max_tokens
        if reason == "length":  # no end-of-sequence token: one character a token
            assert len(text) == tokens == max_tokens, prompt
    assert_counted_once(before, after, pairs, [*answers, *streams.values()])
    assert seconds < TIME_LIMIT


def assert_counted_once(before: dict, after: dict, pairs: list, answered: list[tuple]) -> None:
    """The server's metrics moved by exactly the ``answered`` requests: their outcomes, prompt and
    generated tokens; none is left running or waiting."""

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    outcomes = {o: delta("mcore_requests_total", outcome=o) for o in ("length", "stop", "error", "abort")}
    reasons = [reason for _, reason, _ in answered]
    assert outcomes == {o: reasons.count(o) for o in outcomes}
    assert delta("mcore_generation_tokens_total") == sum(tokens for _, _, tokens in answered)
    prompt_tokens = sum(len(prompt) for prompt, _ in pairs) * (1 + REQUESTS // DISTINCT)
    assert delta("mcore_prompt_tokens_total") == prompt_tokens
    assert after[("mcore_requests_running", ())] == after[("mcore_requests_waiting", ())] == 0
