"""The coordinator: one ZMQ ROUTER socket between asyncio clients and data-parallel engines."""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import zmq

from .errors import (
    CoordinatorError,
    EngineLostError,
    IllegalControlSignalError,
    InvalidRequestError,
    ProtocolError,
)
from .protocol import (
    CONTROL_ACKS,
    PROTOCOL_VERSION,
    MessageKind,
    decode,
    encode,
    partial_outputs,
    sampling_params_from_dict,
)
from .routing import Router, RoutingPolicy
from .serving_state import ServingState, next_state

_logger = logging.getLogger(__name__)

_SIGNALS = {
    MessageKind.PAUSE: "pause",
    MessageKind.UNPAUSE: "unpause",
    MessageKind.SUSPEND: "suspend",
    MessageKind.RESUME: "resume",
    MessageKind.STOP: "stop",
}
_ACK_SIGNALS = {ack: signal for signal, ack in CONTROL_ACKS.items()}
_MAX_MESSAGES_PER_POLL = 1000
_STATS = ("kv_cache_usage", "prefix_cache_hit_tokens", "prefix_cache_query_tokens")  # from engine heartbeats


@dataclass
class _Engine:
    identity: bytes
    name: str
    last_seen: float
    in_flight: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)  # its last heartbeat's cache statistics


@dataclass
class _Request:
    request_id: int  # the coordinator's, unique across clients
    client: bytes
    client_request_id: int
    prompt_tokens: list[int]
    sampling_params: dict[str, Any]
    stream: bool
    engine: bytes | None = None
    tokens_streamed: int = 0
    resubmissions: int = 0
    queued_at: float = 0.0  # when it last began to wait for an engine


@dataclass
class _Control:
    signal: MessageKind
    client: bytes
    waiting: set[bytes]


class InferenceCoordinator:
    """Routes requests from ``InferenceClient``s to engines (``EngineEndpoint``s, each driving a
    ``DynamicInferenceEngine`` in its own process, here or on another machine) over one ZMQ
    ROUTER socket, in a background thread.

    ``host``/``port``: where to bind (``127.0.0.1`` unless told otherwise; ``"0.0.0.0"`` or an
    interface address for engines on other machines); ``port=None`` binds a free port, which
    ``port``/``address`` report after ``start()`` (``broadcast_coordinator_address`` hands it to
    other ranks). ``routing``: a ``RoutingPolicy`` (``prefix_block_size`` is the affinity unit).

    Control signals (``InferenceClient.pause`` ...) follow ``ServingState``'s transitions; an
    illegal one is refused with an error, and a legal one is acknowledged to its client only when
    every live engine has acted on it. An engine is lost when nothing, not even a heartbeat, came
    from it for ``heartbeat_timeout`` seconds (engines heartbeat every ``heartbeat_interval``
    seconds of ``EngineEndpoint``): its unfinished requests that had streamed no token yet are
    re-submitted to a live engine (at most ``max_resubmissions`` times each), the others fail
    with an ``EngineLostError`` message, and serving goes on. Requests that arrive while no engine
    is connected wait for one (``max_queue_wait`` seconds at most, if given: then they fail with a
    ``CoordinatorError`` message). A malformed frame is logged and answered with an ``ERROR``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        routing: RoutingPolicy | str = RoutingPolicy.ROUND_ROBIN,
        prefix_block_size: int = 16,
        heartbeat_timeout: float = 5.0,
        max_resubmissions: int = 1,
        max_queue_wait: float | None = None,
    ):
        if not (heartbeat_timeout > 0):
            raise ValueError(f"heartbeat_timeout must be > 0 seconds, got {heartbeat_timeout!r}")
        if max_queue_wait is not None and not (max_queue_wait >= 0):
            raise ValueError(f"max_queue_wait must be >= 0 seconds or None, got {max_queue_wait!r}")
        self.host = host
        self.port = port
        self.router = Router(routing, prefix_block_size)
        self.heartbeat_timeout = heartbeat_timeout
        self.max_resubmissions = max_resubmissions
        self.max_queue_wait = max_queue_wait
        self.state = ServingState.RUNNING
        self._engines: dict[bytes, _Engine] = {}
        self._live: tuple[str, ...] = ()  # the engines' names, for other threads to read
        self._clients: set[bytes] = set()
        self._requests: dict[int, _Request] = {}
        self._by_client: dict[tuple[bytes, int], int] = {}
        self._queue: deque[int] = deque()  # requests waiting for an engine
        self._control: _Control | None = None
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None

    # ----------------------------------------------------------------- life cycle (any thread)
    @property
    def address(self) -> str:
        """``tcp://host:port`` to give ``InferenceClient`` and ``EngineEndpoint``."""
        if self.port is None:
            raise CoordinatorError("the coordinator is not started; call start() first")
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> str:
        """Bind the socket and serve in a background thread; return ``address``."""
        if self._thread is not None:
            raise CoordinatorError("the coordinator was already started")
        self._thread = threading.Thread(target=self._serve, name="mcore-coordinator", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            raise CoordinatorError(f"cannot bind {self.host}:{self.port}: {self._error}") from self._error
        return self.address

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket, returning once its port is free again; the engines
        keep running (they connect to the next coordinator at this address). To end them too, a
        client sends ``shutdown``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._socket is not None:
                _wait_until_released(self.host, self.port, timeout)

    def __enter__(self) -> InferenceCoordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engines(self) -> list[str]:
        """Names of the live engines."""
        return list(self._live)

    @property
    def running(self) -> bool:
        """Whether the serving thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def wait_for_engines(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` engines are connected; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self._live) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._live)} of {count} engines connected after {timeout} s")
            time.sleep(0.02)

    # ----------------------------------------------------------------- the serving thread
    def _serve(self) -> None:
        context = zmq.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, and is dropped
        try:
            if self.port is None:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
            else:
                sock.bind(f"tcp://{self.host}:{self.port}")
        except zmq.ZMQError as error:
            self._error = error
            sock.close()
            self._bound.set()
            return
        self._socket = sock
        self._bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(timeout=min(50, int(self.heartbeat_timeout * 250))):
                    for _ in range(_MAX_MESSAGES_PER_POLL):  # then check liveness, however busy
                        if self._stop.is_set():
                            break
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(frames)
                self._check_liveness()
                self._expire_queue()
        except Exception:
            _logger.exception("the coordinator's serving thread failed")
            raise
        finally:
            sock.close(linger=200)  # a shutdown's last messages go out

    def _send(self, identity: bytes, kind: MessageKind, **fields: Any) -> None:
        try:
            self._socket.send_multipart([identity, encode(kind, **fields)])
        except zmq.ZMQError as error:  # the peer is gone (ROUTER_MANDATORY): nothing to deliver
            _logger.warning("cannot send %s to %r: %s", kind.name, identity, error)

    def _error_to(self, identity: bytes, code: str, message: str, **fields: Any) -> None:
        self._send(identity, MessageKind.ERROR, code=code, message=message, **fields)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            _logger.warning("dropped a message of %d frames (expected identity and one frame)", len(frames))
            return
        identity, frame = frames
        try:
            kind, fields = decode(frame)
        except ProtocolError as error:
            _logger.warning("malformed frame from %r: %s", identity, error)
            extra = {} if error.request_id is None else {"request_id": error.request_id}
            self._error_to(identity, "malformed", str(error), **extra)
            return
        engine = self._engines.get(identity)
        if engine is not None:
            engine.last_seen = time.monotonic()
        try:
            if kind is MessageKind.CONNECT:
                self._connect(identity, fields)
            elif engine is not None:
                self._from_engine(engine, kind, fields)
            elif identity in self._clients:
                self._from_client(identity, kind, fields)
            else:
                self._error_to(identity, "not_connected", f"send CONNECT before {kind.name}")
        except ProtocolError as error:
            _logger.warning("bad %s from %r: %s", kind.name, identity, error)
            self._error_to(identity, "malformed", str(error))
        except Exception as error:  # a bug here must not end the serving thread
            _logger.exception("handling %s from %r failed", kind.name, identity)
            request_id = fields.get("request_id")
            extra = {"request_id": request_id} if isinstance(request_id, int) else {}
            self._error_to(identity, "internal", f"{type(error).__name__}: {error}", **extra)

    def _connect(self, identity: bytes, fields: dict[str, Any]) -> None:
        if fields["version"] != PROTOCOL_VERSION:
            message = f"protocol version {fields['version']} is not this coordinator's {PROTOCOL_VERSION}"
            self._error_to(identity, "version", message)
            return
        role = fields["role"]
        if role == "engine" and self.state is ServingState.STOPPED:
            self._error_to(identity, "stopped", "the engines were stopped; this coordinator takes no more")
            return
        if role == "engine":
            if identity in self._engines:  # it restarted: what it had is gone
                self._lose_engine(identity, "it connected again")
            self._engines[identity] = _Engine(identity, fields["name"], time.monotonic())
            self.router.add_engine(identity)
            self._live = tuple(e.name for e in self._engines.values())
            _logger.info("engine %s connected", fields["name"])
        elif role == "client":
            self._clients.add(identity)
        else:
            raise ProtocolError(f"CONNECT: role must be 'engine' or 'client', got {role!r:.50}")
        self._send(identity, MessageKind.CONNECT_ACK, version=PROTOCOL_VERSION, state=self.state.value)
        if role == "engine":
            self._dispatch_queue()

    # ----------------------------------------------------------------- clients
    def _from_client(self, client: bytes, kind: MessageKind, fields: dict[str, Any]) -> None:
        if kind is MessageKind.SUBMIT:
            self._submit(client, fields)
        elif kind is MessageKind.ABORT:
            self._abort(client, fields["request_id"])
        elif kind in _SIGNALS:
            self._control_signal(client, kind)
        elif kind is MessageKind.SHUTDOWN:
            self._shutdown(client)
        elif kind is MessageKind.HEARTBEAT:  # a client's heartbeat is answered with the status
            self._send(
                client,
                MessageKind.HEARTBEAT,
                load=len(self._requests),
                waiting=len(self._queue),
                engines=len(self._engines),
                state=self.state.value,
                **self._cache_stats(),
            )
        else:
            self._error_to(client, "unexpected", f"a client does not send {kind.name}")

    def _cache_stats(self) -> dict[str, float]:
        """The live engines' cache statistics: mean KV-cache usage, summed prefix-cache tokens."""
        reported = [e.stats for e in self._engines.values() if e.stats]
        if not reported:
            return {}
        return {
            "kv_cache_usage": sum(s.get("kv_cache_usage", 0.0) for s in reported) / len(reported),
            "prefix_cache_hit_tokens": sum(s.get("prefix_cache_hit_tokens", 0) for s in reported),
            "prefix_cache_query_tokens": sum(s.get("prefix_cache_query_tokens", 0) for s in reported),
        }

    def _reply_failed(
        self, client: bytes, client_request_id: int, error: str, status: str = "failed"
    ) -> None:
        result = {
            "request_id": client_request_id,
            "status": status,
            "generated_tokens": [],
            "finish_reason": "abort" if status == "aborted" else "error",
            "error": error if status == "failed" else None,
        }
        self._send(client, MessageKind.REPLY, request_id=client_request_id, result=result)

    def _submit(self, client: bytes, fields: dict[str, Any]) -> None:
        client_id = fields["request_id"]
        if (client, client_id) in self._by_client:
            self._error_to(
                client, "duplicate", f"request {client_id} is already in flight", request_id=client_id
            )
            return
        if self.state is ServingState.STOPPED:
            self._reply_failed(client, client_id, "CoordinatorError: the engines were stopped")
            return
        tokens = fields["prompt_tokens"]
        try:
            if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise InvalidRequestError("prompt", "must be a non-empty list of token ids (ints)")
            sampling_params_from_dict(fields["sampling_params"])  # field names; the engine checks values
        except (InvalidRequestError, TypeError) as error:
            self._reply_failed(client, client_id, f"InvalidRequestError: {error}")
            return
        request = _Request(
            next(self._ids), client, client_id, tokens, fields["sampling_params"], fields["stream"]
        )
        self._requests[request.request_id] = request
        self._by_client[(client, client_id)] = request.request_id
        request.queued_at = time.monotonic()
        self._queue.append(request.request_id)
        self._dispatch_queue()

    def _dispatch_queue(self) -> None:
        while self._queue and self._engines:
            request = self._requests.get(self._queue.popleft())
            if request is not None:
                self._dispatch(request)

    def _dispatch(self, request: _Request) -> None:
        loads = {identity: len(e.in_flight) for identity, e in self._engines.items()}
        identity = self.router.choose(request.prompt_tokens, loads)
        request.engine = identity
        self._engines[identity].in_flight.add(request.request_id)
        self._send(
            identity,
            MessageKind.SUBMIT,
            request_id=request.request_id,
            prompt_tokens=request.prompt_tokens,
            sampling_params=request.sampling_params,
            stream=request.stream,
        )

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        self._by_client.pop((request.client, request.client_request_id), None)
        if request.engine is not None and request.engine in self._engines:
            self._engines[request.engine].in_flight.discard(request.request_id)

    def _abort(self, client: bytes, client_id: int) -> None:
        request_id = self._by_client.get((client, client_id))
        if request_id is None:  # finished already (or never sent): its reply was or will be sent
            self._error_to(
                client, "unknown_request", f"no unfinished request {client_id}", request_id=client_id
            )
            return
        request = self._requests[request_id]
        if request.engine is None:  # still queued here
            self._forget(request)
            self._reply_failed(client, client_id, "", status="aborted")
        else:
            self._send(request.engine, MessageKind.ABORT, request_id=request_id)

    def _control_signal(self, client: bytes, kind: MessageKind) -> None:
        if self._control is not None:
            message = f"{_SIGNALS[self._control.signal]} is still being acknowledged by the engines"
            self._error_to(client, "busy", message, signal=_SIGNALS[kind])
            return
        try:
            self.state = next_state(self.state, _SIGNALS[kind])
        except IllegalControlSignalError as error:
            self._error_to(client, "illegal_transition", str(error), signal=error.signal, state=error.state)
            return
        self._control = _Control(kind, client, set(self._engines))
        for identity in self._engines:
            self._send(identity, kind)
        self._maybe_ack()

    def _maybe_ack(self) -> None:
        control = self._control
        if control is not None and not control.waiting:
            self._control = None
            self._send(control.client, CONTROL_ACKS[control.signal], state=self.state.value)
            if self.state is ServingState.STOPPED:  # nothing will serve what is left
                for request in list(self._requests.values()):
                    self._forget(request)
                    self._reply_failed(
                        request.client,
                        request.client_request_id,
                        "CoordinatorError: the engines were stopped",
                    )

    def _shutdown(self, client: bytes) -> None:
        for identity in list(self._engines):
            self._send(identity, MessageKind.SHUTDOWN)
        for request in list(self._requests.values()):
            self._forget(request)
            self._reply_failed(
                request.client, request.client_request_id, "CoordinatorError: the coordinator shut down"
            )
        self._send(client, MessageKind.SHUTDOWN)
        self._stop.set()

    # ----------------------------------------------------------------- engines
    def _from_engine(self, engine: _Engine, kind: MessageKind, fields: dict[str, Any]) -> None:
        if kind is MessageKind.HEARTBEAT:
            engine.stats = {
                name: fields[name]
                for name in _STATS
                if isinstance(fields.get(name), (int, float)) and not isinstance(fields[name], bool)
            }
            self._send(engine.identity, MessageKind.HEARTBEAT, load=len(self._requests))
        elif kind is MessageKind.PARTIAL_REPLY:
            self._forward_partials(engine, partial_outputs(fields))
        elif kind is MessageKind.REPLY:
            request = self._requests.get(fields["request_id"])
            if request is None or request.engine != engine.identity:
                return  # from an engine it was taken away from (it was thought lost)
            self._forget(request)
            result = dict(
                fields["result"],
                request_id=request.client_request_id,
                engine=engine.name,
                resubmissions=request.resubmissions,
            )
            self._send(request.client, MessageKind.REPLY, request_id=request.client_request_id, result=result)
        elif kind in _ACK_SIGNALS:
            control = self._control
            if control is not None and _ACK_SIGNALS[kind] is control.signal:
                control.waiting.discard(engine.identity)
                if kind is MessageKind.STOP_ACK:  # it has shut down (its requests replied to)
                    self._engines.pop(engine.identity, None)
                    self.router.remove_engine(engine.identity)
                    self._live = tuple(e.name for e in self._engines.values())
                self._maybe_ack()
        elif kind is MessageKind.ERROR:
            _logger.warning("engine %s: %s: %s", engine.name, fields["code"], fields["message"])
        else:
            self._error_to(engine.identity, "unexpected", f"an engine does not send {kind.name}")

    def _forward_partials(self, engine: _Engine, outputs: list[dict[str, Any]]) -> None:
        """Send each client one ``PARTIAL_REPLY`` with its streams' outputs among ``outputs``."""
        by_client: dict[bytes, list[dict[str, Any]]] = {}
        for output in outputs:
            request = self._requests.get(output["request_id"])
            if request is None or request.engine != engine.identity or not request.stream:
                continue  # ended, aborted, or taken from an engine thought lost
            request.tokens_streamed += len(output["new_token_ids"])
            by_client.setdefault(request.client, []).append(
                dict(output, request_id=request.client_request_id)
            )
        for client, mine in by_client.items():
            self._send(client, MessageKind.PARTIAL_REPLY, outputs=mine)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for identity, engine in list(self._engines.items()):
            if now - engine.last_seen > self.heartbeat_timeout:
                self._lose_engine(identity, f"no heartbeat for {self.heartbeat_timeout} s")

    def _expire_queue(self) -> None:
        """Fail the requests that have waited for an engine longer than ``max_queue_wait``."""
        if self.max_queue_wait is None or not self._queue:
            return
        now = time.monotonic()
        for request_id in list(self._queue):
            request = self._requests.get(request_id)
            if request is not None and now - request.queued_at <= self.max_queue_wait:
                continue
            self._queue.remove(request_id)
            if request is not None:  # else aborted while it waited: already answered
                self._forget(request)
                message = f"no live engine took the request within {self.max_queue_wait} s"
                self._reply_failed(
                    request.client, request.client_request_id, f"{CoordinatorError.__name__}: {message}"
                )

    def _lose_engine(self, identity: bytes, why: str) -> None:
        engine = self._engines.pop(identity)
        self.router.remove_engine(identity)
        self._live = tuple(e.name for e in self._engines.values())
        _logger.warning("engine %s lost (%s); %d requests in flight", engine.name, why, len(engine.in_flight))
        for request_id in sorted(engine.in_flight):
            request = self._requests[request_id]
            request.engine = None
            if request.tokens_streamed == 0 and request.resubmissions < self.max_resubmissions:
                request.resubmissions += 1
                request.queued_at = time.monotonic()
                self._queue.appendleft(request_id)
                continue
            self._forget(request)
            if request.tokens_streamed:
                reason = f"after streaming {request.tokens_streamed} tokens"
            else:
                reason = f"after {request.resubmissions} re-submissions"
            message = f"{EngineLostError.__name__}: engine {engine.name} was lost ({why}) {reason}"
            self._reply_failed(request.client, request.client_request_id, message)
        self._queue = deque(sorted(self._queue))  # re-submitted requests keep their order
        if not self._engines:  # nowhere to re-submit: fail rather than wait for an engine
            for request_id in [r for r in self._queue if self._requests[r].resubmissions]:
                request = self._requests[request_id]
                self._queue.remove(request_id)
                self._forget(request)
                message = (
                    f"{EngineLostError.__name__}: engine {engine.name} was lost ({why}) and no engine is left"
                )
                self._reply_failed(request.client, request.client_request_id, message)
        self._dispatch_queue()
        if self._control is not None:
            self._control.waiting.discard(identity)
            self._maybe_ack()


def _wait_until_released(host: str, port: int, timeout: float) -> None:
    """Wait until ``host:port`` can be bound again (ZMQ closes a listener in its I/O thread, after
    ``close()`` returned)."""
    deadline = time.monotonic() + timeout
    host = "0.0.0.0" if host == "*" else host
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
            try:
                probe.bind((host, port))
                return
            except OSError as error:
                if error.errno != errno.EADDRINUSE:  # not an IPv4 address we can probe: do not wait
                    return
                if time.monotonic() > deadline:
                    _logger.warning("port %d of %s still bound %s s after close", port, host, timeout)
                    return
        time.sleep(0.01)


def broadcast_coordinator_address(
    address: str | None, group: dist.ProcessGroup | None = None, src: int = 0
) -> str:
    """``address`` of global rank ``src`` (e.g. ``InferenceCoordinator.start()``'s) on every rank of
    ``group`` (collective; the other ranks pass ``None``)."""
    holder = [address]
    dist.broadcast_object_list(holder, src=src, group=group)
    if not isinstance(holder[0], str):
        raise CoordinatorError(f"rank {src} broadcast no coordinator address")
    return holder[0]
