"""Run a test body on several ranks: forked processes joined by a fresh gloo process group.

Forking a test process that has already imported torch costs milliseconds, and each call gets
its own rendezvous (a ``FileStore`` in a temporary directory), so hundreds of distributed cases
stay cheap on a 2-core machine and never see each other's keys or ports.

A failing rank is reported with its own traceback; a rank that hangs (for example in a collective
its peers never join) is interrupted at ``timeout``, and the error shows the stack every unfinished
rank was stuck in.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import importlib.util
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 30.0
# After one rank fails, its peers get this long to finish before they are killed: they are often
# blocked in a collective that the failed rank will never join.
_GRACE_AFTER_FAILURE_S = 2.0
# Gloo sometimes fails to set up a group's connections when the machine is crowded with other
# processes making and dropping loopback connections (a port just freed by one is reused by
# another). That is the transport, not the code under test: such a run is repeated once.
_GLOO_CONNECT_FAILURE = "Gloo connectFullMesh failed"
_STOPPED_AFTER_PEER_FAILED = "stopped after a peer failed"
# Ranks are forked, and a process forked after CUDA's runtime was initialized cannot use CUDA.
# ``torch.cuda.is_available()`` initializes it (and so poisons every later fork) unless it is told
# to ask NVML instead: this makes every availability check in the forking process fork-safe.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


class DistributedTestError(AssertionError):
    """One or more ranks failed, crashed or timed out; the message holds each rank's report."""


def run_distributed(
    body: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``body(*args, **kwargs)`` on ``world_size`` forked ranks and return their results.

    With ``init_process_group`` (the default) each rank joins a new default process group of
    ``backend`` before ``body`` runs (and exits with it, see ``_run_rank``); without it, the ranks get the usual
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` environment and set
    up the group themselves. Results come back in rank order and must be picklable.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died without
            reporting, or had not finished after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    import torch

    _import_lazy_modules_once()
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "run_distributed forks its ranks, and CUDA is already initialized in the test process; "
            "touch CUDA only inside the body"
        )
    ranks = _run_once(body, world_size, args, kwargs, timeout, backend, init_process_group)
    if _only_gloo_failed_to_connect(ranks):
        warnings.warn(f"gloo could not connect the ranks of {body!r}; running it once more", stacklevel=2)
        ranks = _run_once(body, world_size, args, kwargs, timeout, backend, init_process_group)
    # The first rank to fail usually caused the others to fail: report it first.
    failures = sorted((rank for rank in ranks if not rank.succeeded), key=lambda rank: rank.reported_at)
    if failures:
        raise DistributedTestError(_failure_report(body, world_size, failures))
    return [rank.result for rank in ranks]


def _only_gloo_failed_to_connect(ranks: list[_Rank]) -> bool:
    """Whether the first rank to fail could not connect a gloo group and every other failed rank
    either hit the same or was stopped waiting for it."""
    failures = sorted((rank for rank in ranks if not rank.succeeded), key=lambda rank: rank.reported_at)
    if not failures or _GLOO_CONNECT_FAILURE not in failures[0].failure:
        return False
    return all(
        _GLOO_CONNECT_FAILURE in rank.failure or rank.failure.startswith(_STOPPED_AFTER_PEER_FAILED)
        for rank in failures[1:]
    )


def _run_once(
    body: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout: float,
    backend: str,
    init_process_group: bool,
) -> list[_Rank]:
    with tempfile.TemporaryDirectory(prefix="mcore-dist-") as workdir:
        rendezvous = _Rendezvous(Path(workdir), world_size, backend, timeout, init_process_group)
        ranks = [_start_rank(rank, rendezvous, body, args, kwargs) for rank in range(world_size)]
        try:
            _collect(ranks, timeout)
        finally:
            for rank in ranks:
                rank.kill()
    return ranks


@functools.cache
def _import_lazy_modules_once() -> None:
    """Import, in the test process, what ranks would otherwise import lazily on first use (sympy
    through ``assert_close``, dynamo through the first ``optimizer.step()``, matplotlib's pyplot for
    the ``loss.png`` every ``mcore-train`` run draws: a second or more each), so forked ranks
    inherit it instead of importing it again per rank."""
    import torch
    import torch._dynamo

    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    if importlib.util.find_spec("matplotlib") is not None:  # only mcore-models needs it
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot


class _Rendezvous:
    """Where the ranks of one call meet: a fresh file store, or a fresh port for ``env://``."""

    def __init__(self, workdir: Path, world_size: int, backend: str, timeout: float, init: bool):
        self.workdir = workdir
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.init = init
        self.store_path = str(workdir / "store")
        self.exit_store_path = str(workdir / "exit-store")
        self.master_port = None if init else _free_port()

    def join(self, rank: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # ranks share the machine's cores
        if not self.init:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self.master_port),
            )
            return
        # Collectives give up a little before the harness does, so a hang usually surfaces as an
        # exception with a traceback from the rank itself.
        dist.init_process_group(
            self.backend,
            store=dist.FileStore(self.store_path, self.world_size),
            rank=rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.timeout * 0.8),
        )

    def wait_for_every_body(self) -> None:
        """Return once every rank's body has returned.

        A rank that exits early closes its sockets while a peer may still be finishing the
        connection handshake of a group they share (``new_group`` returns on one rank before the
        other has read its last message), and that peer's setup then fails.
        """
        import torch.distributed as dist

        store = dist.FileStore(self.exit_store_path, self.world_size)
        store.set_timeout(timedelta(seconds=self.timeout))
        if store.add("bodies_returned", 1) == self.world_size:
            store.set("every_body_returned", "1")
        store.wait(["every_body_returned"])


class _Rank:
    """The parent's view of one forked rank."""

    def __init__(self, rank: int, pid: int, conn: Connection, stack_file: Path):
        self.rank = rank
        self.pid = pid
        self.conn = conn
        self.stack_file = stack_file
        self.reported = False
        self.succeeded = False
        self.result: Any = None
        self.failure = ""
        self.exit_status: int | None = None
        self.reported_at = float("inf")

    def receive(self) -> None:
        try:
            status, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.failure = "exited without reporting a result"
        else:
            self.succeeded = status == "ok"
            self.result = payload if self.succeeded else None
            self.failure = "" if self.succeeded else payload
        self.reported = True
        self.reported_at = time.monotonic()

    def dump_stack(self) -> None:
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        if self.exit_status is not None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, self.exit_status = os.waitpid(self.pid, 0)
        self.conn.close()

    def describe_exit(self) -> str:
        if self.exit_status is None:
            return "still running"
        if os.WIFSIGNALED(self.exit_status):
            return f"killed by {signal.Signals(os.WTERMSIG(self.exit_status)).name}"
        return f"exit code {os.WEXITSTATUS(self.exit_status)}"


def _start_rank(
    rank: int, rendezvous: _Rendezvous, body: Callable[..., Any], args: tuple, kwargs: dict
) -> _Rank:
    receiver, sender = Pipe(duplex=False)
    stack_file = rendezvous.workdir / f"stack-{rank}.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank must never garbage-collect what it inherits: finalizers of the parent's garbage
    # (a gloo process group joining worker threads that do not exist after fork, ...) hang it.
    gc.freeze()
    pid = os.fork()
    if pid == 0:  # the rank
        receiver.close()
        _run_rank(rank, rendezvous, body, args, kwargs, sender, stack_file)
    gc.unfreeze()
    sender.close()
    return _Rank(rank, pid, receiver, stack_file)


def _run_rank(
    rank: int,
    rendezvous: _Rendezvous,
    body: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    sender: Connection,
    stack_file: Path,
) -> None:
    exit_code = 0
    try:
        with open(stack_file, "w") as stacks:
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
            try:
                rendezvous.join(rank)
                # The rank does not destroy its process group: it ends in os._exit, which frees it.
                # Destroying a gloo group deadlocks in about one run in five on torch 2.6: the
                # group's Python dealloc holds the GIL while it joins gloo's worker threads, and a
                # worker freeing the last reference to a finished collective's tensor waits for
                # the GIL (pytorch/pytorch#154976, June 2025, releases the GIL there).
                result = body(*args, **kwargs)
                # Plain pickle: tensors travel by value, not as shared memory that would vanish
                # with this process.
                sender.send_bytes(pickle.dumps(("ok", result)))
                rendezvous.wait_for_every_body()
            except BaseException:
                sender.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    except BaseException:
        exit_code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _collect(ranks: list[_Rank], timeout: float) -> None:
    """Wait for every rank's report, stopping early once a rank failed and its peers stalled."""
    deadline = time.monotonic() + timeout
    by_conn = {rank.conn: rank for rank in ranks}
    while not all(rank.reported for rank in ranks):
        if any(rank.reported and not rank.succeeded for rank in ranks):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        remaining = deadline - time.monotonic()
        pending = [rank.conn for rank in ranks if not rank.reported]
        ready = wait(pending, timeout=max(remaining, 0))
        if not ready:
            peer_failed = any(rank.reported and not rank.succeeded for rank in ranks)
            reason = _STOPPED_AFTER_PEER_FAILED if peer_failed else f"did not finish within {timeout:g} s"
            _interrupt([rank for rank in ranks if not rank.reported], reason)
            return
        for conn in ready:
            by_conn[conn].receive()


def _interrupt(stalled: list[_Rank], reason: str) -> None:
    for rank in stalled:
        rank.dump_stack()
    time.sleep(0.3)  # let faulthandler write
    for rank in stalled:
        stack = rank.stack_file.read_text() if rank.stack_file.exists() else ""
        rank.failure = f"{reason}; it was here:\n" + (stack or "(no stack captured)")
        rank.kill()


def _failure_report(body: Callable[..., Any], world_size: int, failures: list[_Rank]) -> str:
    name = getattr(body, "__qualname__", repr(body))
    lines = [f"{len(failures)} of {world_size} ranks failed running {name}:"]
    for rank in failures:
        lines.append(f"--- rank {rank.rank} ({rank.describe_exit()}): {rank.failure.rstrip()}")
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
