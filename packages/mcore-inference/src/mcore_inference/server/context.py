"""What the server's handlers share, and reading a request's JSON body within its size bound."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..client import InferenceClient
from .admission import Admission
from .chat_template import ChatTemplate
from .errors import OpenAIError, bad_request
from .metrics import ServerMetrics
from .tokenizer import ServingTokenizer


@dataclass
class ServerContext:
    """The client of the coordinator, the tokenizer and chat template, the served model's name and
    context length, the limits, and the metrics of one app."""

    client: InferenceClient
    tokenizer: ServingTokenizer
    template: ChatTemplate
    model_name: str
    max_model_len: int
    max_body_bytes: int
    admission: Admission
    metrics: ServerMetrics
    api_key: str | None = None
    health_timeout: float = 5.0
    created: int = field(default_factory=lambda: int(time.time()))

    async def read_json(self, request: Request) -> Any:
        """The request's JSON body: 413 beyond ``max_body_bytes``, 400 if it is not JSON."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(len(body), limit)
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise bad_request(None, f"the request body is not valid JSON: {error}") from None

    def check_model(self, body: Any) -> None:
        """404 if the body names a model other than the served one."""
        if isinstance(body, dict) and body.get("model") is not None and body["model"] != self.model_name:
            raise OpenAIError(
                404,
                f"the model {body['model']!r:.100} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"the request body of {size} bytes exceeds the limit of {limit} bytes", code="too_large"
    )
