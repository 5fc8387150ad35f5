"""The coordinator's wire protocol: message kinds, one msgpack frame per message, and validation
of what arrives (a malformed frame raises ``ProtocolError``; it never reaches the handlers)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import msgpack

from .errors import InvalidRequestError, ProtocolError
from .sampling_params import SamplingParams

PROTOCOL_VERSION = 2
"""Version of the coordinator protocol; a peer connecting with another one is refused (version 2:
a ``PARTIAL_REPLY`` carries the new tokens of several requests)."""

MAX_FRAME_BYTES = 64 << 20
"""Largest frame ``decode`` accepts (a prompt of millions of tokens fits)."""


class MessageKind(enum.IntEnum):
    """Kinds of coordinator messages; each frame is the msgpack array ``[kind, fields]``.

    ``CONNECT``/``CONNECT_ACK`` is the handshake (``role`` ``"engine"`` or ``"client"``, the
    ``version``); clients ``SUBMIT`` and ``ABORT`` requests, engines answer with
    ``PARTIAL_REPLY`` messages (streamed requests only: each carries ``outputs``, the tokens one
    step generated for any number of requests, see ``partial_outputs``) and one ``REPLY`` per
    request; the control
    signals ``PAUSE``, ``UNPAUSE``, ``SUSPEND``, ``RESUME`` and ``STOP`` go from a client to every
    engine, each of which answers with the matching ``*_ACK``, and the client gets that ack once
    all engines have acted; ``SHUTDOWN`` ends the coordinator and its engines; ``HEARTBEAT``
    carries an engine's load and keeps it alive; ``ERROR`` answers what cannot be done (``code``,
    ``message``)."""

    CONNECT = 1
    CONNECT_ACK = 2
    SUBMIT = 3
    PARTIAL_REPLY = 4
    REPLY = 5
    ABORT = 6
    PAUSE = 7
    UNPAUSE = 8
    SUSPEND = 9
    RESUME = 10
    STOP = 11
    PAUSE_ACK = 12
    UNPAUSE_ACK = 13
    SUSPEND_ACK = 14
    RESUME_ACK = 15
    STOP_ACK = 16
    SHUTDOWN = 17
    HEARTBEAT = 18
    ERROR = 19


CONTROL_ACKS = {
    MessageKind.PAUSE: MessageKind.PAUSE_ACK,
    MessageKind.UNPAUSE: MessageKind.UNPAUSE_ACK,
    MessageKind.SUSPEND: MessageKind.SUSPEND_ACK,
    MessageKind.RESUME: MessageKind.RESUME_ACK,
    MessageKind.STOP: MessageKind.STOP_ACK,
}
"""Each control signal and the ack an engine (then the coordinator) answers it with."""

_INT = (int,)
_REQUIRED: dict[MessageKind, dict[str, tuple[type, ...]]] = {
    MessageKind.CONNECT: {"version": _INT, "role": (str,), "name": (str,)},
    MessageKind.CONNECT_ACK: {"version": _INT, "state": (str,)},
    MessageKind.SUBMIT: {
        "request_id": _INT,
        "prompt_tokens": (list,),
        "sampling_params": (dict,),
        "stream": (bool,),
    },
    MessageKind.PARTIAL_REPLY: {"outputs": (list,)},
    MessageKind.REPLY: {"request_id": _INT, "result": (dict,)},
    MessageKind.ABORT: {"request_id": _INT},
    MessageKind.HEARTBEAT: {"load": _INT},
    MessageKind.ERROR: {"code": (str,), "message": (str,)},
}


def encode(kind: MessageKind, **fields: Any) -> bytes:
    """One frame: the msgpack array ``[int(kind), fields]``."""
    return msgpack.packb([int(kind), fields], use_bin_type=True)


def decode(frame: bytes) -> tuple[MessageKind, dict[str, Any]]:
    """``(kind, fields)`` of a frame made by ``encode``; ``ProtocolError`` for anything else: not
    msgpack, not a ``[kind, map]`` pair, an unknown kind, a required field missing or of the wrong
    type. Fields beyond the required ones are kept (newer peers may send more)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not a msgpack frame: {type(error).__name__}: {error}") from None
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[1], dict)):
        raise ProtocolError("a frame must be the msgpack array [kind, fields]")
    raw_kind, fields = message
    if isinstance(raw_kind, bool) or not isinstance(raw_kind, int):
        raise ProtocolError(f"message kind must be an int, got {raw_kind!r:.50}")
    try:
        kind = MessageKind(raw_kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {raw_kind}") from None
    if not all(isinstance(key, str) for key in fields):
        raise ProtocolError(f"{kind.name}: field names must be strings")
    for name, types in _REQUIRED.get(kind, {}).items():
        value = fields.get(name)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            request_id = fields.get("request_id")
            readable = isinstance(request_id, int) and not isinstance(request_id, bool)
            raise ProtocolError(
                f"{kind.name}: field {name!r} must be {expected}, got {value!r:.50}",
                request_id if readable else None,
            )
    return kind, fields


def partial_outputs(fields: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``outputs`` of a decoded ``PARTIAL_REPLY``: maps with an int ``request_id`` and a list
    ``new_token_ids`` (optionally ``logprobs`` and ``top_logprobs``, lists of the same length, and
    with a request's first tokens ``prompt_logprobs`` and ``prompt_top_logprobs``);
    ``ProtocolError`` naming the first item that is not."""
    outputs = fields["outputs"]
    for index, item in enumerate(outputs):
        request_id = item.get("request_id") if isinstance(item, dict) else None
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ProtocolError(f"PARTIAL_REPLY: outputs[{index}] has no int 'request_id'")
        if not isinstance(item.get("new_token_ids"), list):
            raise ProtocolError(f"PARTIAL_REPLY: outputs[{index}]: 'new_token_ids' must be list", request_id)
    return outputs


_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """``params`` as a plain ``dict`` of its fields (msgpack-ready)."""
    return dataclasses.asdict(params)


def sampling_params_from_dict(fields: Mapping[str, Any]) -> SamplingParams:
    """A ``SamplingParams`` from a ``dict`` of its fields (missing ones take their defaults);
    ``InvalidRequestError`` naming an unknown field. The values are checked by the engine that
    serves the request (``SamplingParams.validate``), which fails the request if one is wrong."""
    if not isinstance(fields, Mapping):
        raise InvalidRequestError("sampling_params", f"must be a map of fields, got {type(fields).__name__}")
    unknown = sorted(str(name) for name in fields if name not in _PARAM_FIELDS)
    if unknown:
        raise InvalidRequestError(
            unknown[0], f"is not a field of SamplingParams ({', '.join(sorted(_PARAM_FIELDS))})"
        )
    return SamplingParams(**fields)
