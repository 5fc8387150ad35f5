"""The asyncio client of an ``InferenceCoordinator``: submit (whole or streamed), abort, control."""

from __future__ import annotations

import asyncio
import itertools
import logging
import numbers
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from .errors import CoordinatorError, IllegalControlSignalError, InvalidRequestError, ProtocolError
from .protocol import (
    CONTROL_ACKS,
    PROTOCOL_VERSION,
    MessageKind,
    decode,
    encode,
    partial_outputs,
    sampling_params_to_dict,
)
from .sampling_params import SamplingParams

_logger = logging.getLogger(__name__)

# What the coordinator answers each message a client waits on with.
_ANSWERS = {
    MessageKind.CONNECT: MessageKind.CONNECT_ACK,
    MessageKind.SHUTDOWN: MessageKind.SHUTDOWN,
    MessageKind.HEARTBEAT: MessageKind.HEARTBEAT,  # a client's heartbeat is answered with the status
    **CONTROL_ACKS,
}


@dataclass
class RequestResult:
    """A finished request as the coordinator reported it.

    ``status`` is ``"completed"``, ``"failed"`` or ``"aborted"`` (as ``RequestStatus``);
    ``error`` says why a request failed (``"InvalidRequestError: ..."``, ``"EngineLostError:
    ..."``, ...); ``engine`` names the engine that served it (``None`` if none did);
    ``resubmissions`` counts how often it was re-submitted after losing an engine; ``details``
    is the whole reply, the engine's ``Request.to_dict()`` (log-probabilities, timestamps,
    events)."""

    request_id: int
    status: str
    generated_tokens: list[int]
    finish_reason: str | None
    error: str | None
    engine: str | None
    resubmissions: int
    details: dict[str, Any] = field(repr=False)

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> RequestResult:
        """The result of a ``REPLY``'s ``result`` map."""
        return cls(
            request_id=reply["request_id"],
            status=reply.get("status", "failed"),
            generated_tokens=list(reply.get("generated_tokens") or []),
            finish_reason=reply.get("finish_reason"),
            error=reply.get("error"),
            engine=reply.get("engine"),
            resubmissions=reply.get("resubmissions", 0),
            details=reply,
        )


@dataclass
class CoordinatorStatus:
    """What ``InferenceClient.status`` reports: the ``ServingState`` value (``"running"``, ...),
    how many engines are live, how many requests are unfinished, and how many of those wait for
    an engine (the rest are on one); from the engines' last heartbeats, their mean KV-cache usage
    (the share of blocks held by requests) and their prompt tokens served from / looked up in
    their prefix caches so far (lost engines' counts leave the sums)."""

    state: str
    engines: int
    requests: int
    waiting: int
    kv_cache_usage: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0


@dataclass
class StreamOutput:
    """One chunk of a streamed request: its new tokens; the last has ``finished`` and ``result``.
    When the request asks for them (``SamplingParams.logprobs`` / ``top_n_logprobs``),
    ``logprobs`` and ``top_logprobs`` hold the new tokens' log-probabilities (else ``None``);
    with ``SamplingParams.prompt_logprobs``, the first chunk holds the prompt's in
    ``prompt_logprobs`` (and ``prompt_top_logprobs`` with ``top_n_logprobs``), as
    ``Request.prompt_logprobs`` has them (``None`` for the first prompt token)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    result: RequestResult | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


def _last_output(request_id: int, result: RequestResult, streamed: int) -> StreamOutput:
    """The last chunk of a stream: the tokens (and log-probabilities) not streamed yet."""
    details = result.details
    params = details.get("sampling_params") or {}
    output = StreamOutput(request_id, result.generated_tokens[streamed:], True, result)
    if params.get("logprobs"):
        output.logprobs = list(details.get("generated_logprobs") or [])[streamed:]
    if params.get("top_n_logprobs"):
        output.top_logprobs = [dict(d) for d in (details.get("generated_top_logprobs") or [])[streamed:]]
    if params.get("prompt_logprobs") and not streamed:
        output.prompt_logprobs = list(details.get("prompt_logprobs") or [])
        if params.get("top_n_logprobs"):
            output.prompt_top_logprobs = list(details.get("prompt_top_logprobs") or [])
    return output


class _Failure:
    """An error for a waiter, put in its queue."""

    def __init__(self, error: Exception):
        self.error = error


class InferenceClient:
    """Talks to the coordinator at ``address`` from a running asyncio loop.

    ``generate`` returns the ``RequestResult``; ``stream`` yields a ``StreamOutput`` per token.
    Leaving a stream early, or cancelling a ``generate``, aborts the request; ``abort`` does it
    by id. ``pause``, ``unpause``, ``suspend``, ``resume`` and ``stop`` return once every engine
    has acted (``IllegalControlSignalError`` if the serving state does not allow the signal,
    ``CoordinatorError`` if another signal is still being acknowledged); ``shutdown`` ends the
    coordinator and its engines. The client connects on first use, in each event loop it is used
    from (one at a time: it works in one loop repeatedly, or across ``asyncio.run`` calls).
    ``timeout`` (seconds) bounds the handshake, each control signal, and silence: while requests
    are unfinished the client heartbeats, and if nothing comes from the coordinator for
    ``timeout`` they fail with ``CoordinatorError`` (a request may take longer; a dead
    coordinator is not waited for)."""

    def __init__(self, address: str, *, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Queue] = {}
        self._waiter: asyncio.Future | None = None  # of the handshake or a control signal
        self._answer: MessageKind | None = None  # the kind that resolves it
        self._lock: asyncio.Lock | None = None
        self._connected = False

    # ----------------------------------------------------------------- connection
    async def connect(self) -> None:
        """Connect and handshake in the running loop (done by every call when needed);
        ``CoordinatorError`` if no coordinator answers within ``timeout``."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new loop: the old socket belongs to the old one
            self._drop_socket()
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            if self._connected and self._reader is not None and not self._reader.done():
                return
            self._drop_socket()
            self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
            self._reader = loop.create_task(self._read())
            try:
                await self._request_reply(
                    MessageKind.CONNECT, version=PROTOCOL_VERSION, role="client", name="client"
                )
            except BaseException:
                self._drop_socket()
                raise
            self._connected = True

    async def close(self) -> None:
        """Close the socket; unfinished requests of this client fail with ``CoordinatorError``."""
        self._drop_socket()

    def _drop_socket(self) -> None:
        self._fail_pending(CoordinatorError("the client was closed"))
        if self._reader is not None and self._loop is not None and not self._loop.is_closed():
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._reader = None
        self._connected = False

    def _send(self, kind: MessageKind, **fields: Any) -> None:
        self._sock.send(encode(kind, **fields))  # a DEALER below its high-water mark sends at once

    async def _request_reply(self, kind: MessageKind, **fields: Any) -> dict[str, Any]:
        """Send ``kind`` and wait for its answer (with the lock held: one at a time)."""
        self._waiter = self._loop.create_future()
        self._answer = _ANSWERS[kind]
        self._send(kind, **fields)
        try:
            return await asyncio.wait_for(self._waiter, self.timeout)
        except TimeoutError:
            raise CoordinatorError(
                f"no answer to {kind.name} from {self.address} in {self.timeout} s"
            ) from None
        finally:
            self._waiter = None

    async def _read(self) -> None:
        loop, sock = asyncio.get_running_loop(), self._sock
        interval = min(1.0, self.timeout / 4)
        last_heard = loop.time()
        while True:
            # poll, not wait_for(recv()): Python 3.11's wait_for swallows a cancellation that
            # arrives as a frame does, and this loop then outlives asyncio.run's shutdown
            if not await sock.poll(interval * 1000, zmq.POLLIN):
                if not self._pending:
                    last_heard = loop.time()  # nothing to wait for: silence is fine
                elif loop.time() - last_heard > self.timeout:
                    self._fail_pending(CoordinatorError(f"no answer from {self.address} in {self.timeout} s"))
                else:  # the coordinator answers, so a live one is heard from even when idle
                    self._send(MessageKind.HEARTBEAT, load=len(self._pending))
                continue
            frame = await sock.recv(zmq.NOBLOCK)  # ready: completes at once
            last_heard = loop.time()
            try:
                kind, fields = decode(frame)
            except ProtocolError as error:
                _logger.warning("malformed frame from the coordinator: %s", error)
                continue
            if kind is MessageKind.PARTIAL_REPLY:
                self._deliver_partials(fields)
            elif kind is MessageKind.REPLY:
                queue = self._pending.get(fields["request_id"])
                if queue is not None:
                    queue.put_nowait((kind, fields))
            elif kind is MessageKind.ERROR:
                self._error(fields)
            elif kind is self._answer and self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(fields)
            elif kind is MessageKind.HEARTBEAT:  # the answer to the reader's own heartbeat
                pass
            else:  # e.g. the ack of a handshake nobody waits for: never taken for another answer
                _logger.debug("unexpected %s from the coordinator", kind.name)

    def _deliver_partials(self, fields: dict[str, Any]) -> None:
        """Put each output of a ``PARTIAL_REPLY`` in its stream's queue."""
        try:
            outputs = partial_outputs(fields)
        except ProtocolError as error:
            _logger.warning("malformed PARTIAL_REPLY from the coordinator: %s", error)
            return
        for output in outputs:
            queue = self._pending.get(output["request_id"])
            if queue is not None:
                queue.put_nowait((MessageKind.PARTIAL_REPLY, output))

    def _fail_pending(self, error: Exception) -> None:
        for queue in self._pending.values():
            queue.put_nowait(_Failure(error))
        self._pending.clear()

    def _error(self, fields: dict[str, Any]) -> None:
        code, message = fields["code"], fields["message"]
        if code == "illegal_transition":
            error: Exception = IllegalControlSignalError(
                fields.get("signal", "?"), fields.get("state", "?"), message
            )
        elif code in ("version", "malformed"):
            error = ProtocolError(message)
        else:
            error = CoordinatorError(f"{code}: {message}")
        request_id = fields.get("request_id")
        if code == "unknown_request":
            return  # an abort that raced with the request's end: its reply comes (or came) anyway
        if request_id is not None and request_id in self._pending:
            self._pending[request_id].put_nowait(_Failure(error))
        elif code == "not_connected":  # the coordinator restarted: what it had is gone
            self._fail_pending(CoordinatorError("the coordinator restarted"))
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(CoordinatorError("the coordinator restarted"))
            self._connected = False  # the next call handshakes again before it sends anything
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        else:
            _logger.warning("coordinator error: %s: %s", code, message)

    # ----------------------------------------------------------------- requests
    async def _submit(
        self, prompt_tokens: Sequence[int], sampling_params: SamplingParams | None, stream: bool
    ):
        await self.connect()
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(params).__name__}")
        if hasattr(prompt_tokens, "tolist"):  # a tensor or an array
            prompt_tokens = prompt_tokens.tolist()
        if isinstance(prompt_tokens, (str, bytes)) or not isinstance(prompt_tokens, Sequence):
            raise InvalidRequestError(
                "prompt", f"must be a list of token ids, got {type(prompt_tokens).__name__}"
            )
        # numpy ints become ints; anything else goes as it is, for the coordinator to refuse
        tokens = [
            int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
            for t in prompt_tokens
        ]
        try:
            frame = encode(
                MessageKind.SUBMIT,
                request_id=(request_id := next(self._ids)),
                prompt_tokens=tokens,
                sampling_params=sampling_params_to_dict(params),
                stream=stream,
            )
        except (TypeError, ValueError) as error:  # msgpack cannot carry it
            raise InvalidRequestError("prompt", f"cannot be sent: {error}") from None
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request_id] = queue
        self._sock.send(frame)
        return request_id, queue

    async def stream(
        self, prompt_tokens: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Yield a ``StreamOutput`` per generated token of the request, the last one with
        ``finished=True`` and the ``RequestResult`` (and the tokens not yet yielded, if any).
        Leaving early (``break``, cancellation) aborts the request."""
        request_id, queue = await self._submit(prompt_tokens, sampling_params, stream=True)
        streamed, finished = 0, False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Failure):
                    raise item.error
                kind, fields = item
                if kind is MessageKind.PARTIAL_REPLY:
                    streamed += len(fields["new_token_ids"])
                    yield StreamOutput(
                        request_id,
                        list(fields["new_token_ids"]),
                        False,
                        logprobs=fields.get("logprobs"),
                        top_logprobs=fields.get("top_logprobs"),
                        prompt_logprobs=fields.get("prompt_logprobs"),
                        prompt_top_logprobs=fields.get("prompt_top_logprobs"),
                    )
                else:
                    result = RequestResult.from_reply(fields["result"])
                    finished = True
                    yield _last_output(request_id, result, streamed)
                    return
        finally:
            self._pending.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

    async def generate(
        self, prompt_tokens: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> RequestResult:
        """Submit a request and return its ``RequestResult`` once it ends (completed, failed or
        aborted; a failed request is returned, not raised). Cancelling the call aborts it."""
        request_id, queue = await self._submit(prompt_tokens, sampling_params, stream=False)
        finished = False
        try:
            item = await queue.get()
            if isinstance(item, _Failure):
                raise item.error
            finished = True
            return RequestResult.from_reply(item[1]["result"])
        finally:
            self._pending.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

    def _abort_quietly(self, request_id: int) -> None:
        """Abort a request that nobody waits for any more (best effort: the loop may be closing)."""
        if self._sock is None or self._loop is None or self._loop.is_closed():
            return
        try:
            self._send(MessageKind.ABORT, request_id=request_id)
        except Exception as error:  # a closed socket or loop: the request ends with its engine
            _logger.debug("could not abort request %d: %s", request_id, error)

    async def abort(self, request_id: int) -> bool:
        """Abort request ``request_id`` of this client: ``True`` if it was unfinished (its stream or
        ``generate`` then ends with status ``"aborted"``), ``False`` if it had already ended."""
        await self.connect()
        if request_id not in self._pending:
            return False
        self._send(MessageKind.ABORT, request_id=request_id)
        return True

    # ----------------------------------------------------------------- control
    async def status(self) -> CoordinatorStatus:
        """The coordinator's ``CoordinatorStatus`` now (``CoordinatorError`` if it does not
        answer within ``timeout``)."""
        await self.connect()
        async with self._lock:
            fields = await self._request_reply(MessageKind.HEARTBEAT, load=len(self._pending))
        return CoordinatorStatus(
            state=str(fields.get("state", "")),
            engines=int(fields.get("engines", 0)),
            requests=int(fields.get("load", 0)),
            waiting=int(fields.get("waiting", 0)),
            kv_cache_usage=float(fields.get("kv_cache_usage", 0.0)),
            prefix_cache_hit_tokens=int(fields.get("prefix_cache_hit_tokens", 0)),
            prefix_cache_query_tokens=int(fields.get("prefix_cache_query_tokens", 0)),
        )

    async def _control(self, kind: MessageKind) -> str:
        await self.connect()
        async with self._lock:
            fields = await self._request_reply(kind)
        return fields.get("state", "")

    async def pause(self) -> None:
        """Stop the engines stepping (allowed while running); returns once all have paused."""
        await self._control(MessageKind.PAUSE)

    async def unpause(self) -> None:
        """Step again (allowed while paused)."""
        await self._control(MessageKind.UNPAUSE)

    async def suspend(self) -> None:
        """Free every engine's KV cache, keeping their requests (allowed while paused)."""
        await self._control(MessageKind.SUSPEND)

    async def resume(self) -> None:
        """Reallocate the KV caches (allowed while suspended); the engines stay paused."""
        await self._control(MessageKind.RESUME)

    async def stop(self) -> None:
        """Shut the engines down (allowed while paused): their unfinished requests fail and the
        coordinator serves nothing more."""
        await self._control(MessageKind.STOP)

    async def shutdown(self) -> None:
        """End the engines and the coordinator, from any state; unfinished requests fail."""
        await self.connect()
        async with self._lock:
            await self._request_reply(MessageKind.SHUTDOWN)
        self._drop_socket()
