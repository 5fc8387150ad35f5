"""The engine from a running asyncio loop: streams of a request's outputs, and one task per loop
that steps the engine in a worker thread while requests are unfinished."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from .request import Request, RequestOutput
from .sampling_params import SamplingParams

_logger = logging.getLogger(__name__)


class SteppedEngine(Protocol):
    """What the driver uses of ``DynamicInferenceEngine``."""

    @property
    def suspended(self) -> bool: ...

    def add_request(self, prompt, sampling_params=None, *, on_output=None) -> Request: ...

    def abort(self, request_id: int) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Request]: ...


class AsyncDriver:
    """``stream`` and ``generate`` for ``engine`` (its ``stream``/``generate_async``); a step that
    raises in the driving task is logged and its message given to ``fail_unfinished``."""

    def __init__(self, engine: SteppedEngine, fail_unfinished: Callable[[str], None]):
        self.engine = engine
        self.fail_unfinished = fail_unfinished
        self._task: asyncio.Task | None = None

    async def stream(
        self, prompt: Sequence[int] | str, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """See ``DynamicInferenceEngine.stream``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(output: RequestOutput) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, output)

        request = self.engine.add_request(prompt, sampling_params, on_output=deliver)
        if request.finished:  # failed validation; its output was already delivered
            yield await queue.get()
            return
        try:
            self._ensure_task(loop)
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:  # left early: nobody wants the rest
            if not request.finished:
                self.engine.abort(request.request_id)

    async def generate(
        self, prompt: Sequence[int] | str, sampling_params: SamplingParams | None = None
    ) -> Request:
        """See ``DynamicInferenceEngine.generate_async``."""
        stream = self.stream(prompt, sampling_params)
        try:
            async for output in stream:
                if output.finished:
                    return output.request
        finally:
            await stream.aclose()  # runs the stream's abort now, not when it is collected
        raise AssertionError("a stream always ends with a finished output")

    def _ensure_task(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._drive())

    async def _drive(self) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():  # after shutdown() none is
            if engine.suspended:
                await asyncio.sleep(0.01)
                continue
            try:
                await asyncio.to_thread(engine.step)
            except Exception as error:  # nobody awaits this task: log it, and wake every waiter
                _logger.exception("engine step raised; failing the unfinished requests")
                self.fail_unfinished(f"{type(error).__name__}: {error}")
