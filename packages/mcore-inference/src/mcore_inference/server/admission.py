"""Who gets in: a bound on concurrent generation requests, and the drain that refuses new ones."""

from __future__ import annotations

import asyncio

from .errors import OpenAIError, unavailable


class Admission:
    """Admits at most ``max_concurrency`` generation requests at a time (one more is answered
    429); once ``draining`` (the server got SIGTERM), every new one is answered 503.
    ``in_flight`` counts those admitted and not yet done; ``idle()`` waits until it is 0."""

    def __init__(self, max_concurrency: int):
        if not (isinstance(max_concurrency, int) and max_concurrency >= 1):
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        self.in_flight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        """Admit one request, or raise the ``OpenAIError`` that refuses it."""
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.in_flight >= self.max_concurrency:
            raise OpenAIError(
                429,
                f"the server is at its limit of {self.max_concurrency} concurrent requests; retry later",
                type="rate_limit_error",
                code="too_many_requests",
            )
        self.in_flight += 1

    def leave(self) -> None:
        """One admitted request is done."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no request in flight; whether that happened."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
