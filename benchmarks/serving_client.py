"""The load a serving benchmark sends: streamed OpenAI completions of token-id prompts (greedy,
``ignore_eos``, ``max_tokens`` per request), arriving as a Poisson process of a given rate (or
all at once) with at most a given number in flight; what each request saw comes back as a
``RequestRecord``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from serving_metrics import RequestRecord

REQUEST_TIMEOUT_S = 600.0


def arrival_delays(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``count`` requests is sent: a Poisson process of
    ``rate`` requests a second (exponential gaps), or all at 0 for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if rate == float("inf"):
        return [0.0] * count
    rng, now, delays = random.Random(seed), 0.0, []
    for _ in range(count):
        delays.append(now)
        now += rng.expovariate(rate)
    return delays


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed greedy completion of exactly ``max_tokens`` tokens, with the usage chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _read_stream(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    """Time the chunks of an SSE completion stream into ``record``."""
    last = None
    async for line in response.aiter_lines():
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data:") :])
        now = time.perf_counter()
        if chunk.get("usage"):
            record.output_tokens = chunk["usage"]["completion_tokens"]
        if any(choice.get("text") for choice in chunk.get("choices", ())):
            if last is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
    record.latency = (last or time.perf_counter()) - sent


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestRecord:
    """Send one streamed completion and time it; failures are recorded, not raised."""
    record = RequestRecord(prompt_tokens=len(prompt), output_tokens_asked=max_tokens)
    sent = time.perf_counter()
    try:
        body = completion_body(model, prompt, max_tokens)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return record
            await _read_stream(response, record, sent)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
        record.error = f"{type(error).__name__}: {error}"
        return record
    if not record.ttft:
        record.error = "no streamed chunk carried text"
    elif record.output_tokens != max_tokens:
        record.error = f"generated {record.output_tokens} tokens, asked for {max_tokens} with ignore_eos"
    record.success = not record.error
    return record


class _InFlight:
    """At most ``limit`` requests at once (``None``: no limit), and the most seen at once."""

    def __init__(self, limit: int | None):
        self._semaphore = asyncio.Semaphore(limit) if limit else None
        self.now = self.most = 0

    async def __aenter__(self) -> None:
        if self._semaphore:
            await self._semaphore.acquire()
        self.now += 1
        self.most = max(self.most, self.now)

    async def __aexit__(self, *exc) -> None:
        self.now -= 1
        if self._semaphore:
            self._semaphore.release()


async def run_load(
    url: str,
    model: str,
    requests: list[tuple[list[int], int]],
    rate: float,
    max_concurrency: int | None,
    seed: int = 0,
) -> tuple[list[RequestRecord], float, int]:
    """Send ``requests`` (prompt, output length) on the arrival schedule; the records in request
    order, the run's duration (first send to last finish) and the most requests in flight at once."""
    in_flight = _InFlight(max_concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()

        async def one(delay: float, prompt: list[int], max_tokens: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            async with in_flight:
                return await send_request(client, url, model, prompt, max_tokens)

        delays = arrival_delays(len(requests), rate, seed)
        records = await asyncio.gather(*(one(d, p, n) for d, (p, n) in zip(delays, requests, strict=True)))
        duration = time.perf_counter() - start
    return list(records), duration, in_flight.most
