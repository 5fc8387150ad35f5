"""Starting the ranks: use torchrun's when there are any, else fork (CPU) or spawn (GPU) them here.

Locally started ranks meet on a free port of 127.0.0.1 (``find_free_port``) and share the CPU
cores evenly (``torch.set_num_threads``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mcore_api import experimental_api, internal_api
from mcore_parallel import find_free_port, get_backend

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@internal_api
def under_torchrun() -> bool:
    """Whether this process is one rank of an externally launched job (torchrun, SLURM wrappers...)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def default_world_size() -> int:
    """Every visible GPU, else 2 ranks on a CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@internal_api
def run_in_process_group(worker: Callable[..., Any], *args: Any) -> Any:
    """Join the process group described by the environment, run ``worker(*args)``, leave the group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(get_backend())
    try:
        return worker(*args)
    finally:
        dist.destroy_process_group()


def _rank_entry(local_rank: int, world_size: int, port: int, threads: int, worker, args) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    run_in_process_group(worker, *args)


@experimental_api
def launch_local(worker: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``worker(*args)`` on ``world_size`` new local ranks and wait for all of them.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback included).
    """
    port = find_free_port()
    threads = max(1, available_cores() // world_size)
    start_method = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(
        _rank_entry,
        args=(world_size, port, threads, worker, args),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
