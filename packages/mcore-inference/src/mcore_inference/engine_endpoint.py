"""An engine's side of the coordinator: a DEALER socket feeding a ``DynamicInferenceEngine``."""

from __future__ import annotations

import logging
import os
import socket as _socket
import threading
import time
from typing import Any, Protocol

import zmq

from .errors import EngineGroupError, InvalidRequestError, ProtocolError
from .protocol import CONTROL_ACKS, PROTOCOL_VERSION, MessageKind, decode, encode, sampling_params_from_dict
from .request import Request, RequestOutput
from .serving_state import ServingState

_logger = logging.getLogger(__name__)


class ServedEngine(Protocol):
    """What ``EngineEndpoint`` uses of ``DynamicInferenceEngine``."""

    def add_request(self, prompt, sampling_params=None, *, on_output=None) -> Request: ...

    def abort(self, request_id: int) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Request]: ...

    def suspend(self) -> int: ...

    def resume(self) -> None: ...

    def shutdown(self) -> None: ...

    # optional: ``cache_stats() -> dict[str, float]``, sent with every heartbeat


class EngineEndpoint:
    """Connects ``engine`` (a ``DynamicInferenceEngine``) to the coordinator at ``address`` and
    serves it: ``run()`` takes requests and control signals from the socket, steps the engine
    while it is running and has work, sends after each step one ``PARTIAL_REPLY`` with the new
    tokens of every streamed request (and their log-probabilities when a request asks for them)
    and one ``REPLY`` (the ``Request.to_dict()``) when a request ends, and a heartbeat (with the
    engine's ``cache_stats()``) every ``heartbeat_interval`` seconds (keep it well below the
    coordinator's ``heartbeat_timeout``). The heartbeat goes on during a step, from a thread of
    its own, so a step longer than the coordinator's ``heartbeat_timeout`` (a long prefill of a
    big model, a machine busy with other work) does not make the engine look lost; the socket is
    used by one thread at a time (under a lock).

    Control signals: ``pause`` stops stepping (requests are kept, new ones queue), ``unpause``
    steps again, ``suspend`` frees the KV cache (``engine.suspend()``), ``resume`` reallocates it
    (still paused), ``stop`` shuts the engine down (its unfinished requests fail) and ends
    ``run()``; each is acknowledged once done. ``shutdown`` from the coordinator does the same
    without an ack. If the coordinator at ``address`` restarts, the endpoint connects to the new
    one (aborting what the old one had sent). ``coordinator_timeout`` (seconds, ``None`` = wait
    forever) ends ``run()`` with ``TimeoutError`` when nothing comes from the coordinator for
    that long. ``close()`` (any thread) ends ``run()`` too. An ``EngineGroupError`` from the
    engine (a rank of a tensor-parallel engine is gone) ends ``run()`` with it: the engine
    cannot serve any more."""

    def __init__(
        self,
        engine: ServedEngine,
        address: str,
        *,
        name: str | None = None,
        heartbeat_interval: float = 0.5,
        coordinator_timeout: float | None = None,
    ):
        self.engine = engine
        self.address = address
        self.name = name if name is not None else f"{_socket.gethostname()}:{os.getpid()}"
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.state = ServingState.RUNNING
        self.shutdown_requested = False  # ended by a coordinator's SHUTDOWN (not STOP or close)
        self._requests: dict[int, Request] = {}  # coordinator request id -> engine request
        self._outbox: list[bytes] = []
        self._partials: list[dict[str, Any]] = []  # streamed tokens not sent yet: one PARTIAL_REPLY
        self._closed = threading.Event()
        self._socket_lock = threading.Lock()  # the socket, _stepping and _last_heartbeat
        self._stepping = False
        self._last_heartbeat = 0.0
        self._epoch = 0  # handshakes so far: outputs of an earlier coordinator's requests are dropped

    def close(self) -> None:
        """Make ``run()`` return (within a step and a poll)."""
        self._closed.set()

    def run(self) -> None:
        """Serve until ``stop``, ``shutdown`` or ``close()``."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)  # let the last replies and acks go out
        sock.connect(self.address)
        self._socket = sock
        beat = threading.Thread(target=self._beat_while_stepping, name="engine-heartbeat", daemon=True)
        try:
            with self._socket_lock:
                self._send(MessageKind.CONNECT, version=PROTOCOL_VERSION, role="engine", name=self.name)
                self._flush()
            beat.start()
            self._serve()
        finally:
            self._closed.set()
            if beat.is_alive():
                beat.join()
            with self._socket_lock:
                self._flush()
                sock.close()

    def _serve(self) -> None:
        """The loop of ``run()``: messages in, a step, messages out, until closed."""
        last_heard = time.monotonic()
        while not self._closed.is_set():
            with self._socket_lock:
                busy = self.state is ServingState.RUNNING and self.engine.has_unfinished_requests()
                if self._socket.poll(0 if busy else 10):
                    last_heard = time.monotonic()
                    self._receive_all()
            if not self._closed.is_set() and self.state is ServingState.RUNNING:
                if self.engine.has_unfinished_requests():
                    self._step()
            now = time.monotonic()
            with self._socket_lock:
                if now - self._last_heartbeat >= self.heartbeat_interval:
                    self._send(MessageKind.HEARTBEAT, load=len(self._requests), **self._cache_stats())
                    self._last_heartbeat = now
                self._flush()
            if self.coordinator_timeout is not None and now - last_heard > self.coordinator_timeout:
                raise TimeoutError(
                    f"nothing from the coordinator at {self.address} for {self.coordinator_timeout} s"
                )

    def _receive_all(self) -> None:
        """Handle every frame waiting on the socket."""
        while not self._closed.is_set():
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._receive(frame)
            except EngineGroupError:
                raise
            except Exception:  # e.g. an engine that refuses: log it, keep serving
                _logger.exception("handling a message from the coordinator failed")

    def _step(self) -> None:
        """One engine step, with the heartbeat thread told that one is under way."""
        with self._socket_lock:
            self._stepping = True
        try:
            self.engine.step()
        except EngineGroupError:
            raise
        except Exception:  # the engine failed that step's requests; serve the rest
            _logger.exception("engine step raised; its requests failed, serving goes on")
        finally:
            with self._socket_lock:
                self._stepping = False

    def _beat_while_stepping(self) -> None:
        """The heartbeat thread: while a step runs past ``heartbeat_interval``, send heartbeats."""
        while not self._closed.wait(self.heartbeat_interval / 4):
            with self._socket_lock:
                now = time.monotonic()
                if self._stepping and now - self._last_heartbeat >= self.heartbeat_interval:
                    frame = encode(MessageKind.HEARTBEAT, load=len(self._requests), **self._cache_stats())
                    self._send_now(frame)
                    self._last_heartbeat = now

    def _cache_stats(self) -> dict[str, float]:
        """The engine's ``cache_stats()`` for the heartbeat (an engine without it reports none)."""
        stats = getattr(self.engine, "cache_stats", None)
        return stats() if callable(stats) else {}

    # ----------------------------------------------------------------- messages
    def _send(self, kind: MessageKind, **fields: Any) -> None:
        self._batch_partials()  # a request's streamed tokens go out before its reply
        self._outbox.append(encode(kind, **fields))

    def _batch_partials(self) -> None:
        """Move the streamed tokens gathered so far to the outbox, as one ``PARTIAL_REPLY``."""
        if self._partials:
            self._outbox.append(encode(MessageKind.PARTIAL_REPLY, outputs=self._partials))
            self._partials = []

    def _flush(self) -> None:
        """Send the outbox (with the socket lock held)."""
        self._batch_partials()
        for frame in self._outbox:
            self._send_now(frame)
        self._outbox.clear()

    def _send_now(self, frame: bytes) -> None:
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # no coordinator for long (its queue is full): drop, never block
            _logger.warning("the coordinator at %s takes no messages; one dropped", self.address)

    def _receive(self, frame: bytes) -> None:
        try:
            kind, fields = decode(frame)
        except ProtocolError as error:
            _logger.warning("malformed frame from the coordinator: %s", error)
            return
        if kind is MessageKind.CONNECT_ACK:
            self._epoch += 1
            for request in list(self._requests.values()):  # a new coordinator knows none of them
                self.engine.abort(request.request_id)
            self._requests.clear()
            self._enter(ServingState(fields["state"]))
        elif kind is MessageKind.ERROR:
            if fields["code"] == "not_connected":  # the coordinator restarted or thought us lost
                self._send(MessageKind.CONNECT, version=PROTOCOL_VERSION, role="engine", name=self.name)
            elif fields["code"] == "stopped":  # asked again at the next heartbeat's answer
                pass
            else:
                _logger.warning("coordinator: %s: %s", fields["code"], fields["message"])
        elif kind is MessageKind.SUBMIT:
            self._submit(fields)
        elif kind is MessageKind.ABORT:
            request = self._requests.get(fields["request_id"])
            if request is not None:
                self.engine.abort(request.request_id)
        elif kind in CONTROL_ACKS:
            target = {
                MessageKind.PAUSE: ServingState.PAUSED,
                MessageKind.UNPAUSE: ServingState.RUNNING,
                MessageKind.SUSPEND: ServingState.SUSPENDED,
                MessageKind.RESUME: ServingState.PAUSED,
                MessageKind.STOP: ServingState.STOPPED,
            }[kind]
            self._enter(target)
            self._send(CONTROL_ACKS[kind], state=self.state.value)
        elif kind is MessageKind.SHUTDOWN:
            self.shutdown_requested = True
            self._enter(ServingState.STOPPED)

    def _enter(self, state: ServingState) -> None:
        """Act on the coordinator's serving state."""
        if state is ServingState.SUSPENDED:
            self.engine.suspend()
        elif self.state is ServingState.SUSPENDED:
            self.engine.resume()
        if state is ServingState.STOPPED:
            self.engine.shutdown()  # fails the unfinished requests: their replies go out
            self._closed.set()
        self.state = state

    def _submit(self, fields: dict[str, Any]) -> None:
        request_id = fields["request_id"]
        stream, epoch = fields["stream"], self._epoch

        def on_output(output: RequestOutput) -> None:
            if epoch != self._epoch:
                return
            if output.finished:
                self._requests.pop(request_id, None)
                result = output.request.to_dict()
                result["request_id"] = request_id
                self._send(MessageKind.REPLY, request_id=request_id, result=result)
            elif stream and output.new_token_ids:
                partial = {"request_id": request_id, "new_token_ids": output.new_token_ids}
                self._partials.append(dict(partial, **_new_logprobs(output)))

        try:
            params = sampling_params_from_dict(fields["sampling_params"])
        except (InvalidRequestError, TypeError) as error:
            result = {
                "request_id": request_id,
                "status": "failed",
                "generated_tokens": [],
                "finish_reason": "error",
            }
            result["error"] = f"InvalidRequestError: {error}"
            self._send(MessageKind.REPLY, request_id=request_id, result=result)
            return
        request = self.engine.add_request(fields["prompt_tokens"], params, on_output=on_output)
        if not request.finished:
            self._requests[request_id] = request


def _new_logprobs(output: RequestOutput) -> dict[str, Any]:
    """``logprobs`` / ``top_logprobs`` of ``output``'s new tokens, when its request records them;
    with its first tokens also ``prompt_logprobs`` / ``prompt_top_logprobs``, when it asks for them."""
    request, count = output.request, len(output.new_token_ids)
    fields: dict[str, Any] = {}
    if request.sampling_params.logprobs:
        fields["logprobs"] = request.generated_logprobs[-count:]
    if request.sampling_params.top_n_logprobs:
        fields["top_logprobs"] = [dict(d) for d in request.generated_top_logprobs[-count:]]
    if request.sampling_params.prompt_logprobs and count == len(request.generated_tokens):
        fields["prompt_logprobs"] = list(request.prompt_logprobs)
        if request.sampling_params.top_n_logprobs:
            fields["prompt_top_logprobs"] = [
                None if d is None else dict(d) for d in request.prompt_top_logprobs
            ]
    return fields
