"""``mcore-serve`` with 2 engine processes when one of them fails, as a subprocess over loopback
with the unmodified ``openai`` client: a stalled engine (SIGSTOP) does not hold back the requests
on the other one; an engine killed mid-stream (SIGKILL) ends each request in flight within a bounded
time, completed or with an OpenAI error naming the lost engine, re-routes what it had not started,
and the server keeps serving (and stays healthy) on the live engine; with every engine lost,
``/health`` and new requests answer 503 in a bounded time. Oracle: the greedy answers of the same
requests, non-streamed, before the fault."""

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from metrics_scrape import scrape
from serve_process import engine_pids, serve_tiny_model, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # mcore-serve imports torch, starts engines

MODEL = "tiny-llama"
HEARTBEAT_TIMEOUT = 3.0  # --engine-heartbeat-timeout: an engine silent this long is lost
LONG, SHORT = 120, 6  # max_tokens of the requests in flight at the kill, and of the others
SLACK = 20.0  # seconds a crowded machine may add to any bound here
NO_ENGINE_WAIT = 6.0  # --no-engine-wait: how long a request waits for an engine while none is live


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(process, url)`` of the module's ``mcore-serve``; stopped after its tests."""
    options = ["--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--no-engine-wait", str(NO_ENGINE_WAIT)]
    process, url = serve_tiny_model(tmp_path_factory.mktemp("faults"), extra_args=options)
    yield process, url
    returncode, output = stop_serve(process)
    assert returncode == 0, output


@dataclass
class Outcome:
    """How a request ended: the text that arrived, the error that ended it (if one did), when."""

    text: str
    error: openai.APIError | None
    ended: float


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def sampling(max_tokens: int) -> dict:
    """Greedy, ``max_tokens`` long whatever the tokens (so a request is in flight for long)."""
    return dict(model=MODEL, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})


async def whole(api, prompt: str, max_tokens: int) -> Outcome:
    try:
        response = await api.completions.create(prompt=prompt, **sampling(max_tokens))
    except openai.APIError as error:
        return Outcome("", error, time.monotonic())
    return Outcome(response.choices[0].text, None, time.monotonic())


async def streamed(api, prompt: str, max_tokens: int, began: asyncio.Event | None = None) -> Outcome:
    """A streamed request; ``began`` is set once its first text arrived."""
    text = ""
    try:
        stream = await api.completions.create(prompt=prompt, stream=True, **sampling(max_tokens))
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            if text and began is not None:
                began.set()
    except openai.APIError as error:
        return Outcome(text, error, time.monotonic())
    return Outcome(text, None, time.monotonic())


def references(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The non-streamed greedy answers to ``prompts`` (checked to succeed)."""

    async def answer():
        api = client(url)
        try:
            return await asyncio.gather(*(whole(api, p, max_tokens) for p in prompts))
        finally:
            await api.close()

    outcomes = asyncio.run(answer())
    assert all(o.error is None for o in outcomes), outcomes
    return [o.text for o in outcomes]


def test_a_stalled_engine_does_not_hold_back_the_other(served):
    """Round robin gives each engine two of four streams: while one engine is stopped the other's
    two finish; the stopped one's wait, and finish once it goes on. (Stopped past the heartbeat
    timeout, it would be taken for lost and its unstarted requests moved to the live engine.)"""
    process, url = served
    prompts = [f"stall {i}: " for i in range(4)]
    expected = references(url, prompts, SHORT)

    async def body():
        api = client(url)
        stalled = engine_pids(process)[0]
        os.kill(stalled, signal.SIGSTOP)
        try:
            started = time.monotonic()
            tasks = [asyncio.ensure_future(streamed(api, p, SHORT)) for p in prompts]
            while sum(t.done() for t in tasks) < 2 and time.monotonic() < started + SLACK:
                await asyncio.sleep(0.02)
            while_stalled, stalled_for = sum(t.done() for t in tasks), time.monotonic() - started
        finally:
            os.kill(stalled, signal.SIGCONT)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await api.close()
        return while_stalled, stalled_for, outcomes

    while_stalled, stalled_for, outcomes = asyncio.run(body())
    assert while_stalled >= 2, "the live engine's streams were held back"
    if stalled_for < HEARTBEAT_TIMEOUT:  # the stalled engine's two had to wait for it
        assert while_stalled == 2
    assert [(o.text, o.error) for o in outcomes] == [(text, None) for text in expected]


def wait_for_engines(url: str, count: int) -> None:
    """Wait until ``/health`` reports ``count`` live engines (a stalled one may have reconnected)."""
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT + SLACK
    while httpx.get(f"{url}/health", timeout=30).json().get("engines") != count:
        assert time.monotonic() < deadline, f"not {count} live engines"
        time.sleep(0.1)


async def kill_mid_stream(url: str, victim: int, prompts: list[str]) -> tuple[list[Outcome], list, float]:
    """Start ``prompts`` (streamed, and every third one whole), SIGKILL ``victim`` once every
    stream has text, then send ``prompts`` again (short); ``(in-flight outcomes, outcomes of those
    sent after the kill, time of the kill)``. ``/health`` is polled meanwhile: always 200."""
    api, health = client(url), httpx.AsyncClient(timeout=30)
    began = [asyncio.Event() for _ in prompts]
    in_flight = [
        whole(api, p, LONG) if i % 3 == 2 else streamed(api, p, LONG, began[i]) for i, p in enumerate(prompts)
    ]
    in_flight = [asyncio.ensure_future(request) for request in in_flight]
    await asyncio.wait_for(asyncio.gather(*(b.wait() for i, b in enumerate(began) if i % 3 != 2)), 60)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    after = [asyncio.ensure_future(whole(api, p, SHORT)) for p in prompts[:2]]
    after += [asyncio.ensure_future(streamed(api, p, SHORT)) for p in prompts[2:4]]
    everything = asyncio.ensure_future(asyncio.gather(*in_flight, *after))
    while not everything.done():
        assert time.monotonic() - killed < HEARTBEAT_TIMEOUT + 3 * SLACK, "a request did not end"
        status = (await health.get(f"{url}/health")).status_code
        assert status == 200, f"/health answered {status} with an engine alive"
        await asyncio.wait([everything], timeout=0.2)
    everything.result()
    await api.close()
    await health.aclose()
    return [t.result() for t in in_flight], [t.result() for t in after], killed


def test_an_engine_killed_mid_stream(served):
    """Runs after the stall test (it kills an engine; the next test kills the other). What the
    lost engine had begun fails with an error event (or a 503) naming it, within the heartbeat
    timeout; the rest completes, equal to the oracle; requests routed to the dead engine before
    its loss was noticed are re-routed."""
    process, url = served
    wait_for_engines(url, 2)
    prompts = [f"kill {i}: " for i in range(9)]
    expected, expected_short = references(url, prompts, LONG), references(url, prompts[:8], SHORT)
    before = scrape(url)
    outcomes, after_kill, killed = asyncio.run(kill_mid_stream(url, engine_pids(process)[-1], prompts))
    failed = [o for o in outcomes if o.error is not None]
    assert failed and len(failed) < len(outcomes), "both engines or neither served requests"
    for outcome, text in zip(outcomes, expected, strict=True):
        if outcome.error is None:
            assert outcome.text == text
            continue
        assert outcome.error.code == "engine_lost", outcome.error
        assert "EngineLostError: engine engine" in outcome.error.message
        assert text.startswith(outcome.text)  # what arrived before the loss was right
        assert outcome.ended - killed < HEARTBEAT_TIMEOUT + SLACK
    assert [(o.text, o.error) for o in after_kill] == [(text, None) for text in expected_short[:4]]
    # half of them went to the dead engine: they could only end once its loss was noticed
    assert max(o.ended for o in after_kill) > min(o.ended for o in failed)
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["engines"] == 1
    metrics = scrape(url)
    assert metrics[("mcore_engines_live", ())] == 1
    errors = ("mcore_requests_total", (("outcome", "error"),))
    assert metrics[errors] - before.get(errors, 0.0) == len(failed)
    assert metrics[("mcore_requests_running", ())] == 0
    assert serve_on(url, prompts[4:8]) == [(text, None) for text in expected_short[4:8]]


def serve_on(url: str, prompts: list[str]) -> list[tuple[str, openai.APIError | None]]:
    """``(text, error)`` of ``prompts``, the first half streamed, the rest whole."""

    async def send():
        api, half = client(url), len(prompts) // 2
        try:
            return await asyncio.gather(
                *(streamed(api, p, SHORT) for p in prompts[:half]),
                *(whole(api, p, SHORT) for p in prompts[half:]),
            )
        finally:
            await api.close()

    return [(o.text, o.error) for o in asyncio.run(send())]


def test_with_every_engine_lost_requests_fail_in_time(served):
    """Runs after the kill: the last engine killed too, ``/health`` answers 503 once the loss is
    noticed, and a request (whole or streamed) fails with a 503 error once it has waited
    ``NO_ENGINE_WAIT`` seconds for an engine, instead of hanging."""
    process, url = served
    wait_for_engines(url, 1)
    os.kill(engine_pids(process)[0], signal.SIGKILL)
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT + SLACK
    while (health := httpx.get(f"{url}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 with no live engine"
        time.sleep(0.1)
    assert health.status_code == 503 and "no live engine" in health.json()["error"]["message"]

    async def send():
        api = client(url)
        try:
            return await asyncio.gather(whole(api, "gone", SHORT), streamed(api, "gone", SHORT))
        finally:
            await api.close()

    started = time.monotonic()
    outcomes = asyncio.run(send())
    assert time.monotonic() - started < NO_ENGINE_WAIT + SLACK
    for outcome in outcomes:
        assert outcome.text == "" and outcome.error.code == "service_unavailable", outcome.error
        assert "no live engine took the request within" in outcome.error.message
    assert outcomes[0].error.status_code == 503
