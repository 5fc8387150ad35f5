"""One data-parallel engine process of ``mcore-serve``: it loads the model itself and serves it
to the coordinator through an ``EngineEndpoint`` until the coordinator shuts it down."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from .config import EngineProcessConfig

COORDINATOR_TIMEOUT = 60.0
"""Seconds without a word from the coordinator after which an engine process exits (so none
outlives a killed ``mcore-serve``)."""


def run_engine(
    model_dir: str, address: str, name: str, config: EngineProcessConfig, max_model_len: int, threads: int
) -> None:
    """Load ``model_dir``, build its engine and serve it at the coordinator ``address``."""
    import torch
    from mcore_models import load_checkpoint_for_inference

    from ..engine import DynamicInferenceEngine
    from ..engine_endpoint import EngineEndpoint

    # A terminal's Ctrl-C, or a SIGTERM to the whole group (systemd, timeout), is the parent's to
    # handle: it drains the server while the engines still serve, then shuts them down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    started = time.monotonic()
    loaded = load_checkpoint_for_inference(model_dir, dtype=getattr(torch, config.dtype))
    engine = DynamicInferenceEngine(
        loaded.model,
        tokenizer=loaded.tokenizer,
        max_sequence_length=max_model_len,
        **config.context_kwargs(),
    )
    print(
        f"mcore-serve: {name} loaded the model in {time.monotonic() - started:.1f} s "
        f"({engine.context.num_blocks} KV cache blocks of {engine.context.block_size} tokens)",
        flush=True,
    )
    endpoint = EngineEndpoint(engine, address, name=name, coordinator_timeout=COORDINATOR_TIMEOUT)
    try:
        endpoint.run()
    except TimeoutError:
        print(f"mcore-serve: {name} heard nothing from the coordinator: exiting", flush=True)


def start_engine_processes(
    processes: list[BaseProcess],
    model_dir: Path,
    address: str,
    count: int,
    config: EngineProcessConfig,
    max_model_len: int,
) -> None:
    """Start ``count`` engine processes (spawned, so no state of this one is shared) named
    ``engine0 ..``, sharing the CPU cores evenly; each is appended to ``processes`` as it starts
    (so an interrupted start leaves none unaccounted for)."""
    context = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // count)
    for i in range(count):
        process = context.Process(
            target=run_engine,
            args=(str(model_dir), address, f"engine{i}", config, max_model_len, threads),
            name=f"mcore-serve-engine{i}",
            daemon=True,
        )
        process.start()
        processes.append(process)


def stop_engine_processes(processes: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait up to ``timeout`` seconds for the processes to end, then kill those left."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
