"""``mcore-serve``: the command line (generated from ``ServeConfig`` and ``EngineProcessConfig``)
and the run: load the checkpoint, start the coordinator and the data-parallel engine processes,
serve the OpenAI-compatible API until SIGTERM or SIGINT, then drain and shut everything down."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import torch.distributed
from mcore_models import CheckpointFormatError
from mcore_parallel import ConfigError, add_dataclass_arguments, dataclass_from_args

from ..client import InferenceClient
from ..coordinator import InferenceCoordinator
from ..server import build_app, build_server, load_chat_template
from ..server.tokenizer import TokenizerAdapter
from .config import EngineProcessConfig, ServeConfig
from .engine_process import start_engine_processes, stop_engine_processes, watch_engine_groups
from .errors import ServeStartupError
from .startup import (
    DEFAULT_MODEL_DIR,
    FrontEndModel,
    bind_http_socket,
    load_front_end_model,
    resolve_model_dir,
)

DESCRIPTION = (
    "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) with "
    "data-parallel engines, each of one or more tensor-parallel processes. MODEL_DIR: an mcore-train "
    "checkpoint (save directory or an iter_NNNNNNN directory) or a Hugging Face model directory; "
    f"default ./{DEFAULT_MODEL_DIR}, where `mcore-train` writes."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser: MODEL_DIR and an option per field of the two configs."""
    parser = argparse.ArgumentParser(prog="mcore-serve", description=DESCRIPTION)
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="The model to serve.")
    add_dataclass_arguments(parser, ServeConfig)
    add_dataclass_arguments(parser, EngineProcessConfig)
    return parser


def parse_serve_args(
    argv: Sequence[str] | None, parser: argparse.ArgumentParser
) -> tuple[str | None, ServeConfig, EngineProcessConfig]:
    """MODEL_DIR and the configs of ``argv``; ``ConfigError`` naming an invalid field."""
    namespace = parser.parse_args(argv)
    serve = dataclass_from_args(ServeConfig, namespace)
    engine = dataclass_from_args(EngineProcessConfig, namespace)
    return namespace.model_dir, serve, engine


class _StartupSignals:
    """SIGTERM and SIGINT interrupt the start-up (``KeyboardInterrupt``, so what started is
    stopped); once serving, the server handles them and their re-raise after it stops is ignored."""

    def __init__(self) -> None:
        self.serving = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, frame: object) -> None:
        if not self.serving:
            raise KeyboardInterrupt(signal.Signals(sig).name)


def _wait_for_engines(
    coordinator: InferenceCoordinator, processes: list[BaseProcess], count: int, timeout: float
) -> None:
    """Block until ``count`` engines have connected, reporting each; ``ServeStartupError`` if one
    of their processes exits first or ``timeout`` seconds pass."""
    deadline, ready = time.monotonic() + timeout, 0
    while ready < count:
        for process in processes:
            if process.exitcode is not None:
                raise ServeStartupError(
                    f"{process.name} exited with code {process.exitcode} while loading (its output is above)"
                )
        if time.monotonic() > deadline:
            raise ServeStartupError(
                f"{ready} of {count} engines ready after {timeout} s (--engine-startup-timeout)"
            )
        if len(coordinator.engines) > ready:
            ready = len(coordinator.engines)
            print(f"mcore-serve: engines ready {ready}/{count}", flush=True)
        time.sleep(0.05)


def _default_model_name(front: FrontEndModel) -> str:
    """The model directory's name; for an mcore-train checkpoint its save directory's (or, for
    ``RUN/checkpoints``, the run's)."""
    directory = front.directory.resolve()
    if front.source == "mcore-train":
        directory = directory.parent
        if directory.name == "checkpoints":
            directory = directory.parent
    return directory.name


def _serve_until_signal(
    front: FrontEndModel, config: ServeConfig, address: str, signals: _StartupSignals, listener: socket.socket
) -> None:
    """Run the HTTP front end on ``listener`` until SIGTERM or SIGINT has drained it; prints its
    URL once up."""
    app = build_app(
        InferenceClient(address),
        TokenizerAdapter(front.tokenizer),
        model_name=config.served_model_name or _default_model_name(front),
        max_model_len=front.max_model_len,
        chat_template=load_chat_template(front.directory),
        api_key=config.api_key,
    )
    server = build_server(
        app, config.host, config.port, graceful_timeout=config.graceful_timeout, log_level=config.log_level
    )
    host = f"[{config.host}]" if ":" in config.host else config.host

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"mcore-serve: serving at http://{host}:{config.port}/v1 (Ctrl-C to stop)", flush=True)
        await task

    signals.serving = True
    asyncio.run(run())


def _shut_down(coordinator: InferenceCoordinator, processes: list[BaseProcess]) -> None:
    """Stop the engines through the coordinator, then the coordinator; kill what lingers."""
    try:
        asyncio.run(asyncio.wait_for(InferenceClient(coordinator.address).shutdown(), 10))
    except Exception as error:
        print(
            f"mcore-serve: the engines did not acknowledge the shutdown ({error}); stopping them", flush=True
        )
    finally:
        coordinator.close()
        stop_engine_processes(processes)


def run(model_dir: str | None, serve: ServeConfig, engine: EngineProcessConfig) -> None:
    """Load, start, serve until a signal, shut down."""
    signals = _StartupSignals()
    listener = bind_http_socket(serve.host, serve.port)
    try:
        _load_start_and_serve(model_dir, serve, engine, signals, listener)
    finally:
        listener.close()
    print("mcore-serve: stopped", flush=True)


def _load_start_and_serve(
    model_dir: str | None,
    serve: ServeConfig,
    engine: EngineProcessConfig,
    signals: _StartupSignals,
    listener: socket.socket,
) -> None:
    """Load the checkpoint, start the coordinator and the engines, serve on ``listener`` until a
    signal, then shut the engines and the coordinator down."""
    tp = serve.tensor_parallel_size
    front = load_front_end_model(resolve_model_dir(model_dir), engine.dtype, serve.max_model_len, tp)
    coordinator = InferenceCoordinator(
        heartbeat_timeout=serve.engine_heartbeat_timeout, max_queue_wait=serve.no_engine_wait
    )
    coordinator.start()
    processes: list[BaseProcess] = []
    stopping = threading.Event()
    # where the ranks of each tensor-parallel engine meet (a port the system picks, held till the end)
    store = (
        torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if tp > 1 else None
    )
    try:
        count = serve.data_parallel_size
        print(f"mcore-serve: starting {_engines_text(count, tp)} ...", flush=True)
        start_engine_processes(
            processes,
            front.directory,
            coordinator.address,
            count,
            tp,
            engine,
            front.max_model_len,
            store_port=0 if store is None else store.port,
        )
        _wait_for_engines(coordinator, processes, count, serve.engine_startup_timeout)
        watch_engine_groups(processes, tp, stopping)
        _serve_until_signal(front, serve, coordinator.address, signals, listener)
    finally:
        signals.serving = True  # a signal now must not interrupt the shutdown
        stopping.set()
        _shut_down(coordinator, processes)


def _engines_text(count: int, tp: int) -> str:
    """``2 engine processes``, or at TP > 1 ``2 engines of 2 tensor-parallel processes``."""
    if tp == 1:
        return f"{count} engine process{'es' if count > 1 else ''}"
    return f"{count} engine{'s' if count > 1 else ''} of {tp} tensor-parallel processes"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mcore-serve``; returns the exit status (2 for bad options, 1 when it cannot
    start, 0 after a signal stopped it cleanly)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    try:
        run(*parse_serve_args(argv, parser))
    except ConfigError as error:
        parser.error(str(error))
    except (ServeStartupError, CheckpointFormatError) as error:
        print(f"mcore-serve: error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("mcore-serve: interrupted during start-up; stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
