"""A request's state, lifecycle events and plain-dict form."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: queued, holding cache blocks, or done (completed, failed or aborted)."""

    WAITING = "waiting"
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"  # by DynamicInferenceEngine.abort or an abandoned stream


class RequestEventType(enum.Enum):
    """Kinds of ``RequestEvent``."""

    ADD = "add"
    FIRST_TOKEN = "first_token"
    PAUSE = "pause"  # engine suspended: cache freed, state kept
    EVICT = "evict"  # preempted for lack of blocks; recomputed later
    FINISH = "finish"
    FAIL = "fail"
    ERROR_TRANSIENT = "error_transient"  # retried
    ERROR_NONTRANSIENT = "error_nontransient"  # fails the request
    ABORT = "abort"  # aborted by the caller; the request ends as ABORTED


@dataclass
class RequestEvent:
    """Something that happened to a request, at ``timestamp`` (``time.time()``)."""

    type: RequestEventType
    timestamp: float
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of the event (JSON/msgpack-ready)."""
        return {"type": self.type.value, "timestamp": self.timestamp, "message": self.message}


@dataclass(eq=False)
class Request:
    """One generation request and everything the engine learned about it.

    ``tokens`` is the prompt followed by the generated tokens; the first ``num_computed_tokens``
    of them have keys/values in the cache blocks ``block_ids``. ``future`` resolves to the
    request itself when it completes, fails or is aborted. ``generator`` is no longer used
    (seeded requests draw from ``sampling_params.seed`` alone) and stays ``None``; it remains for
    compatibility and will be deprecated.
    """

    request_id: int
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    prompt_text: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    generated_tokens: list[int] = field(default_factory=list)
    generated_text: str | None = None
    generated_logprobs: list[float] = field(default_factory=list)
    generated_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    token_timestamps: list[float] = field(default_factory=list)
    events: list[RequestEvent] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    future: Future = field(default_factory=Future)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_tokens)

    def add_event(self, type: RequestEventType, message: str | None = None) -> RequestEvent:
        """Record an event of ``type`` now and return it."""
        event = RequestEvent(type, time.time(), message)
        self.events.append(event)
        return event

    def event_time(self, type: RequestEventType) -> float | None:
        """Timestamp of the first event of ``type``, or ``None``."""
        return next((e.timestamp for e in self.events if e.type is type), None)

    @property
    def finished(self) -> bool:
        """Whether the request completed, failed or was aborted."""
        return self.status in (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.ABORTED)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from being added to the first generated token."""
        added, first = self.event_time(RequestEventType.ADD), self.event_time(RequestEventType.FIRST_TOKEN)
        return None if added is None or first is None else first - added

    def result(self, timeout: float | None = None) -> Request:
        """Block until the request completes, fails or is aborted; return it."""
        return self.future.result(timeout)

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of the request's inputs, outputs and events (JSON/msgpack-ready)."""
        return {
            "request_id": self.request_id,
            "prompt_tokens": list(self.prompt_tokens),
            "prompt_text": self.prompt_text,
            "sampling_params": asdict(self.sampling_params),
            "status": self.status.value,
            "generated_tokens": list(self.generated_tokens),
            "generated_text": self.generated_text,
            "generated_logprobs": list(self.generated_logprobs),
            "generated_top_logprobs": [dict(d) for d in self.generated_top_logprobs],
            "prompt_logprobs": list(self.prompt_logprobs),
            "prompt_top_logprobs": [None if d is None else dict(d) for d in self.prompt_top_logprobs],
            "token_timestamps": list(self.token_timestamps),
            "time_to_first_token": self.time_to_first_token,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "events": [e.to_dict() for e in self.events],
        }


@dataclass
class RequestOutput:
    """What a step produced for one request: its new tokens, and whether it is done."""

    request: Request
    new_token_ids: list[int]
    finished: bool
