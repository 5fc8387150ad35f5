"""``build_app``: the OpenAI-compatible FastAPI app in front of an ``InferenceClient``."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import HTTPException
from fastapi.responses import JSONResponse, Response

from ..client import InferenceClient
from .admission import Admission
from .chat_template import ChatTemplate
from .completions import handle_generation
from .context import ServerContext
from .errors import OpenAIError, bad_request, from_exception, unavailable
from .metrics import ServerMetrics
from .openai_protocol import render_messages
from .tokenizer import ServingTokenizer

_logger = logging.getLogger(__name__)


def build_app(
    client: InferenceClient,
    tokenizer: ServingTokenizer,
    *,
    model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_concurrency: int = 256,
    chat_template: ChatTemplate | None = None,
    health_timeout: float = 5.0,
) -> FastAPI:
    """The OpenAI-compatible app serving ``model_name`` through ``client`` (connected to an
    ``InferenceCoordinator``; used from the server's event loop only).

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
    ``GET /health`` and ``/v1/health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``.
    ``max_model_len`` bounds prompt + output; ``api_key`` (if set) is required as
    ``Authorization: Bearer`` on every route but health and metrics; bodies beyond
    ``max_body_bytes`` get 413 and generation requests beyond ``max_concurrency`` in flight 429.
    ``chat_template``: ``load_chat_template(model_dir)``, or the default ChatML one."""
    ctx = ServerContext(
        client=client,
        tokenizer=tokenizer,
        template=chat_template if chat_template is not None else ChatTemplate(),
        model_name=model_name,
        max_model_len=max_model_len,
        max_body_bytes=max_body_bytes,
        admission=Admission(max_concurrency),
        metrics=ServerMetrics(),
        api_key=api_key,
        health_timeout=health_timeout,
    )
    app = FastAPI(title="mcore-inference", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ctx
    _add_error_handlers(app, ctx)
    _add_generation_routes(app, ctx)
    _add_admin_routes(app, ctx)
    return app


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> Response:
        ctx.metrics.rejected.labels(status=str(error.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return error.response(headers)

    async def no_route(request: Request, error: HTTPException) -> Response:
        ctx.metrics.rejected.labels(status=str(error.status_code)).inc()
        message = f"no route {request.method} {request.url.path}"
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return OpenAIError(error.status_code, message, code="not_found").response()

    for status in (404, 405):  # the router's own errors (Starlette's HTTPException)
        app.add_exception_handler(status, no_route)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        converted = from_exception(error)
        ctx.metrics.rejected.labels(status=str(converted.status)).inc()
        return converted.response()


def _authorizer(ctx: ServerContext):
    async def authorize(request: Request) -> None:
        if ctx.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), ctx.api_key.encode()):
            raise OpenAIError(
                401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key"
            )

    return Depends(authorize)


def _add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    authorized = [_authorizer(ctx)]

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await handle_generation(request, ctx, chat=False)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        return await handle_generation(request, ctx, chat=True)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        model = {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "mcore",
            "max_model_len": ctx.max_model_len,
        }
        return {"object": "list", "data": [model]}


async def _health(ctx: ServerContext) -> Response:
    """200 when requests can be served now; 503 saying why not."""
    try:
        if ctx.admission.draining:
            raise unavailable("the server is shutting down")
        try:
            status = await asyncio.wait_for(ctx.client.status(), ctx.health_timeout)
        except Exception as error:
            raise unavailable(f"the coordinator does not answer: {error}") from None
        ctx.metrics.set_status(status)
        if status.engines == 0:
            raise unavailable("no live engine (loading, or every engine was lost)")
        if status.state != "running":
            raise unavailable(f"the engines are {status.state}")
    except OpenAIError as error:
        return error.response()
    return JSONResponse({"status": "ok", "engines": status.engines, "state": status.state})


def _add_admin_routes(app: FastAPI, ctx: ServerContext) -> None:
    authorized = [_authorizer(ctx)]

    @app.get("/health")
    async def health() -> Response:
        return await _health(ctx)

    @app.get("/v1/health")
    async def v1_health() -> Response:
        return await _health(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            ctx.metrics.set_status(await asyncio.wait_for(ctx.client.status(), ctx.health_timeout))
        except Exception as error:  # the gauges keep their last values; the counters still count
            _logger.warning("/metrics: no status from the coordinator: %s", error)
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await ctx.read_json(request)
        text = _tokenize_text(body, ctx)
        tokens = ctx.tokenizer.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await ctx.read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = ctx.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad_request("tokens", f"tokens must be a list of token ids in [0, {vocab})")
        return {"prompt": ctx.tokenizer.decode(tokens)}


def _tokenize_text(body: Any, ctx: ServerContext) -> str:
    """The text ``/tokenize`` encodes: ``prompt``, or ``messages`` through the chat template."""
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        return body["prompt"]
    if isinstance(body, dict) and body.get("messages") is not None:
        return render_messages(body["messages"], ctx.template)
    raise bad_request("prompt", "give prompt (a string) or messages (a non-empty list)")
