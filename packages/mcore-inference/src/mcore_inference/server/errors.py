"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ..errors import (
    CoordinatorError,
    EngineLostError,
    EngineShutdownError,
    InvalidRequestError,
    MaxSequenceLengthOverflowError,
)


class OpenAIError(Exception):
    """An error the server answers with ``status`` and the OpenAI error body; ``param`` names the
    request field at fault (``None`` when no single field is)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(param: str | None, message: str) -> OpenAIError:
    """400: a request field of the wrong type or outside its allowed range."""
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def unavailable(message: str) -> OpenAIError:
    """503: the engines cannot take requests now (loading, paused, none live, draining)."""
    return OpenAIError(503, message, type="service_unavailable", code="service_unavailable")


def from_exception(error: Exception) -> OpenAIError:
    """The OpenAI error of one of mcore-inference's errors (anything else: 500)."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, InvalidRequestError):
        return bad_request(error.field, str(error))
    if isinstance(error, EngineLostError):
        return OpenAIError(503, str(error), type="engine_lost", code="engine_lost")
    if isinstance(error, CoordinatorError):
        return unavailable(f"the coordinator failed the request: {error}")
    return OpenAIError(500, f"{type(error).__name__}: {error}", type="internal_error", code="internal_error")


def from_failed_result(error: str | None) -> OpenAIError:
    """The OpenAI error of a failed ``RequestResult``'s ``error`` (``"InvalidRequestError: field:
    message"``, ``"EngineLostError: ..."``, ...): 400 naming the field for a refused request (and
    ``max_tokens`` for one longer than the engines' context), 503 for a lost, shut down or
    stopped engine, else 500."""
    text = error or "the request failed"
    kind, _, message = text.partition(": ")
    if kind == InvalidRequestError.__name__:
        field = message.partition(": ")[0] if ": " in message else None
        return bad_request(field, message)
    if kind == MaxSequenceLengthOverflowError.__name__:
        error = bad_request("max_tokens", f"the prompt and max_tokens exceed the engines' context: {message}")
        error.code = "context_length_exceeded"
        return error
    if kind == EngineLostError.__name__:
        return OpenAIError(503, text, type="engine_lost", code="engine_lost")
    if kind in (CoordinatorError.__name__, EngineShutdownError.__name__):
        return unavailable(text)
    return OpenAIError(500, text, type="internal_error", code="internal_error")
