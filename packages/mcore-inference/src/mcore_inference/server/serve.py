"""Running the app under uvicorn, with a SIGTERM that drains before the server stops."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI

from .context import ServerContext

_logger = logging.getLogger(__name__)

_CANCEL_AFTER_SECONDS = 1.0
"""How long uvicorn waits for connections once draining is over, before it cancels their tasks
(which aborts their engine requests)."""

_KEEP_ALIVE_SECONDS = 65.0
"""How long an idle keep-alive connection stays open. Longer than clients keep idle connections
(the ``openai`` client and httpx: 5 s), so the client always closes first: a server that closes
as the client reuses the connection makes that request fail (uvicorn's default is 5 s)."""


def _http_implementation() -> str:
    """uvicorn's HTTP/1.1 implementation: ``"httptools"`` (a dependency: its C parser costs less
    per request than h11) where it imports, else ``"h11"``."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


class DrainingServer(uvicorn.Server):
    """A uvicorn server for an app of ``build_app`` whose first SIGTERM (or SIGINT) drains: new
    generation requests get 503 and ``/health`` says so, requests in flight get up to
    ``graceful_timeout`` seconds to finish, then the server stops and those still running are
    cancelled (their engine requests aborted). A second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, graceful_timeout: float = 30.0):
        super().__init__(config)
        if not (graceful_timeout >= 0):
            raise ValueError(f"graceful_timeout must be >= 0 seconds, got {graceful_timeout!r}")
        self.graceful_timeout = graceful_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        """Serve in the running loop (as ``uvicorn.Server.serve``)."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (callable from any thread): the first signal starts the drain."""
        if self._draining or self._loop is None or self._loop.is_closed():
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        admission = _context(self.config.app).admission
        admission.draining = True
        _logger.info(
            "draining: %d requests in flight, %s s to finish", admission.in_flight, self.graceful_timeout
        )
        if not await admission.idle(self.graceful_timeout):
            _logger.warning(
                "%d requests still in flight after %s s: aborting them",
                admission.in_flight,
                self.graceful_timeout,
            )
        super().handle_exit(sig, None)


def _context(app: FastAPI) -> ServerContext:
    context = getattr(app.state, "server", None)
    if not isinstance(context, ServerContext):
        raise TypeError("the app must come from mcore_inference.server.build_app")
    return context


def build_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    graceful_timeout: float = 30.0,
    log_level: str = "info",
) -> DrainingServer:
    """A ``DrainingServer`` for ``app`` (from ``build_app``) on ``host:port`` (loopback unless told
    otherwise); ``server.run()`` blocks until it stops."""
    _context(app)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=_http_implementation(),
        # asyncio's loop, not uvloop (uvicorn's "auto" takes it where installed): under uvloop a
        # request cancelled at the end of the grace period kept the loop from closing
        # (test_sigterm_aborts_what_outlives_the_grace_period hung).
        loop="asyncio",
        timeout_graceful_shutdown=_CANCEL_AFTER_SECONDS,
        timeout_keep_alive=_KEEP_ALIVE_SECONDS,
    )
    return DrainingServer(config, graceful_timeout)


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    graceful_timeout: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT, draining as ``DrainingServer`` does."""
    build_server(app, host, port, graceful_timeout=graceful_timeout, log_level=log_level).run()
