"""Typed errors of the inference engine."""

from __future__ import annotations


class InferenceError(Exception):
    """Base of every error raised by mcore-inference."""


class ContextOverflowError(InferenceError):
    """A step or a request does not fit the context's limits."""


class RequestOverflowError(ContextOverflowError):
    """More requests in one step than the context's ``max_requests``."""


class TokenOverflowError(ContextOverflowError):
    """More tokens in one step than the context's ``max_tokens``."""


class BlockOverflowError(ContextOverflowError):
    """Not enough free (or evictable) KV-cache blocks."""


class MaxSequenceLengthOverflowError(ContextOverflowError):
    """A sequence longer than the context's ``max_sequence_length``."""


class InvalidRequestError(InferenceError, ValueError):
    """A request that can never be served; ``field`` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineShutdownError(InferenceError):
    """The engine was shut down; it takes no more requests."""


class EngineGroupError(InferenceError):
    """A rank of a tensor-parallel engine is gone (or its control channel failed): the engine
    cannot step any more, and its process should exit so the coordinator counts it lost."""


class PipelineStageError(InferenceError):
    """Another pipeline stage's forward raised a non-transient error in this step (that stage
    raises the error itself)."""


def is_transient(error: Exception) -> bool:
    """Whether a failed forward is worth recomputing: runtime and I/O errors of the device or of a
    collective (``torch.OutOfMemoryError``, ``torch.distributed.DistError``, a pipeline stage's
    failure are ``RuntimeError``s). ``NotImplementedError``, ``RecursionError`` and every other type
    (``TypeError``, ``ValueError``, ``AttributeError``, ``IndexError``, ``InferenceError``, ...) are
    programming errors: they surface."""
    return isinstance(error, (RuntimeError, OSError)) and not isinstance(
        error, (NotImplementedError, RecursionError)
    )


class CoordinatorError(InferenceError):
    """A request to the coordinator that it refused (busy with another control signal, shut
    down, an unknown request) or that got no answer in time."""


class ProtocolError(CoordinatorError):
    """A frame that is not a valid message of the coordinator protocol, or a peer speaking another
    ``PROTOCOL_VERSION``; ``request_id`` is the message's, when it had a readable one."""

    def __init__(self, message: str, request_id: int | None = None):
        super().__init__(message)
        self.request_id = request_id


class IllegalControlSignalError(CoordinatorError, ValueError):
    """A control signal that the serving state does not allow (e.g. ``suspend`` while running:
    pause first); ``state`` and ``signal`` name both."""

    def __init__(self, signal: str, state: str, message: str):
        super().__init__(message)
        self.signal = signal
        self.state = state


class EngineLostError(CoordinatorError):
    """The engine serving a request stopped answering (its process died, or no heartbeat came in
    time) after it had streamed part of the output, so the request could not be re-submitted."""
