"""The engine processes of ``mcore-serve``: per data-parallel engine, one process per
tensor-parallel rank. Each loads its part of the model; rank 0 serves the engine to the coordinator
through an ``EngineEndpoint`` until the coordinator shuts it down, the other ranks follow its steps
(``TensorParallelLeader`` / ``follow_leader``). A rank that dies takes its engine down."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

from .config import EngineProcessConfig

COORDINATOR_TIMEOUT = 60.0
"""Seconds without a word from the coordinator after which an engine process exits (so none
outlives a killed ``mcore-serve``)."""

CONTROL_TIMEOUT = timedelta(days=365)
"""How long the ranks after the first wait for its next call: an idle engine sends none."""


@dataclass
class EngineRank:
    """Where one process stands: engine ``name``, its rank of ``tp`` and, at TP > 1, the
    rendezvous (the parent's ``TCPStore`` at ``store_host:store_port``)."""

    name: str
    rank: int = 0
    tp: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0


def _join_tensor_parallel_group(where: EngineRank):
    """The model-parallel groups of this engine's ranks and a gloo control group over them."""
    import torch.distributed as dist
    from mcore_parallel import initialize_model_parallel

    client = dist.TCPStore(where.store_host, where.store_port, is_master=False)
    store = dist.PrefixStore(where.name, client)
    dist.init_process_group("gloo", store=store, rank=where.rank, world_size=where.tp)
    groups = initialize_model_parallel(tensor_model_parallel_size=where.tp)
    return groups, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _build_engine(model_dir: str, where: EngineRank, config: EngineProcessConfig, max_model_len: int):
    """This rank's engine of ``model_dir`` and, at TP > 1, its control group."""
    import torch
    from mcore_models import load_checkpoint_for_inference
    from mcore_parallel import set_cpu_weight_packing

    from ..engine import DynamicInferenceEngine

    groups, control = _join_tensor_parallel_group(where) if where.tp > 1 else (None, None)
    started = time.monotonic()
    loaded = load_checkpoint_for_inference(
        model_dir, dtype=getattr(torch, config.dtype), pg_collection=groups
    )
    # kernels for every step size built now, not during the first requests
    set_cpu_weight_packing(loaded.model, config.pack_cpu_weights, warm_up_rows=config.max_batch_tokens)
    engine = DynamicInferenceEngine(
        loaded.model,
        tokenizer=loaded.tokenizer,
        max_sequence_length=max_model_len,
        pg_collection=groups,
        **config.context_kwargs(),
    )
    if where.rank == 0:
        print(
            f"mcore-serve: {where.name} loaded the model in {time.monotonic() - started:.1f} s "
            f"(tensor-parallel size {where.tp}; {engine.context.num_blocks} KV cache blocks of "
            f"{engine.context.block_size} tokens)",
            flush=True,
        )
    return engine, control


def run_engine(
    model_dir: str,
    address: str,
    where: EngineRank,
    config: EngineProcessConfig,
    max_model_len: int,
    threads: int,
) -> None:
    """Load this rank's part of ``model_dir`` and serve it at the coordinator ``address`` (rank 0)
    or follow rank 0 (the others); exit with status 1 when another rank of the engine is gone."""
    import torch

    from ..engine_endpoint import EngineEndpoint
    from ..errors import EngineGroupError
    from ..tensor_parallel_engine import TensorParallelLeader, follow_leader

    # A terminal's Ctrl-C, or a SIGTERM to the whole group (systemd, timeout), is the parent's to
    # handle: it drains the server while the engines still serve, then shuts them down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    engine, control = _build_engine(model_dir, where, config, max_model_len)
    served = engine if control is None or where.rank > 0 else TensorParallelLeader(engine, control)
    try:
        if where.rank > 0:
            follow_leader(engine, control)
            return
        EngineEndpoint(served, address, name=where.name, coordinator_timeout=COORDINATOR_TIMEOUT).run()
    except TimeoutError:
        print(f"mcore-serve: {where.name} heard nothing from the coordinator: exiting", flush=True)
        served.shutdown()  # the other ranks too
    except EngineGroupError as error:
        print(f"mcore-serve: {where.name} rank {where.rank}: {error}: exiting", flush=True)
        sys.exit(1)
    finally:
        if control is not None:
            torch.distributed.destroy_process_group()


def start_engine_processes(
    processes: list[BaseProcess],
    model_dir: Path,
    address: str,
    count: int,
    tp: int,
    config: EngineProcessConfig,
    max_model_len: int,
    store_port: int = 0,
) -> None:
    """Start ``count`` engines of ``tp`` processes each (spawned, so no state of this one is
    shared; the ranks of engine ``i`` are ``processes[i * tp:(i + 1) * tp]``), sharing the CPU
    cores evenly; each is appended to ``processes`` as it starts (so an interrupted start leaves
    none unaccounted for). At TP > 1 the ranks meet at the ``TCPStore`` on ``store_port``."""
    context = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // (count * tp))
    for i in range(count):
        for rank in range(tp):
            where = EngineRank(f"engine{i}", rank, tp, store_port=store_port)
            process = context.Process(
                target=run_engine,
                args=(str(model_dir), address, where, config, max_model_len, threads),
                name=f"mcore-serve-engine{i}" + (f"-tp{rank}" if tp > 1 else ""),
                daemon=True,
            )
            process.start()
            processes.append(process)


def watch_engine_groups(
    processes: list[BaseProcess], tp: int, stopping: threading.Event, interval: float = 0.2
) -> threading.Thread:
    """A daemon thread that, until ``stopping`` is set, kills the other ranks of an engine once one
    of its processes has died (exited with a non-zero status or a signal), so the coordinator
    counts that engine lost (heartbeats stop) instead of its ranks waiting on each other forever."""

    def watch() -> None:
        engines = [processes[i : i + tp] for i in range(0, len(processes), tp)]
        while engines and not stopping.is_set():
            for ranks in list(engines):
                gone = [p for p in ranks if p.exitcode not in (None, 0)]
                if gone:
                    engines.remove(ranks)
                    if any(p.is_alive() for p in ranks):
                        print(
                            f"mcore-serve: {gone[0].name} died (exit code {gone[0].exitcode}); stopping its engine",
                            flush=True,
                        )
                        for p in ranks:
                            p.kill()
                elif all(p.exitcode == 0 for p in ranks):
                    engines.remove(ranks)
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="mcore-serve-engine-watch", daemon=True)
    thread.start()
    return thread


def stop_engine_processes(processes: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait up to ``timeout`` seconds for the processes to end, then kill those left."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
