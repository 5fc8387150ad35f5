"""``mcore-serve`` as a subprocess for the command's tests, and the tiny Hugging Face model
directory it serves: a random-weight Llama of vocabulary 128 with the character tokenizer of
``server_stack``."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from mcore_parallel import find_free_port
from server_stack import write_char_tokenizer

MCORE_SERVE = Path(sys.executable).with_name("mcore-serve")
KV_CACHE_BYTES = 4_000_000  # ~1000 blocks of the tiny model: plenty, and quick to allocate


def write_tiny_hf_model(directory: Path) -> Path:
    """A ``save_pretrained`` random-weight Llama (2 layers, 32 wide, GQA) with ``tokenizer.json``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    write_char_tokenizer(directory)
    return directory


def in_process_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], str]]:
    """The oracle: ``(tokens, text)`` per prompt of the checkpoint's in-process engine (TP = 1),
    greedy, ``max_tokens`` each, end-of-sequence ignored (run it in a fresh process)."""
    from mcore_inference import DynamicInferenceEngine, SamplingParams
    from mcore_models import load_checkpoint_for_inference

    loaded = load_checkpoint_for_inference(model_dir)
    engine = DynamicInferenceEngine(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=KV_CACHE_BYTES)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=max_tokens, ignore_eos=True)
    requests = engine.generate(prompts, params)
    return [(list(r.generated_tokens), loaded.tokenizer.decode(list(r.generated_tokens))) for r in requests]


def run_serve(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``mcore-serve ARGS`` in ``cwd`` to its end (for the ways it refuses to start)."""
    return subprocess.run(
        [str(MCORE_SERVE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def start_serve(args: list[str], cwd: Path, port: int, timeout: float = 180) -> subprocess.Popen:
    """Start ``mcore-serve ARGS --port PORT`` and wait until its ``/health`` answers 200."""
    process = _popen_serve(args, cwd, port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"mcore-serve did not become healthy:\n{process.communicate()[0]}")


def start_serve_until(args: list[str], cwd: Path, port: int, line: str, timeout: float = 120):
    """Start ``mcore-serve ARGS --port PORT`` and read its output until a line containing
    ``line``; ``(process, lines so far)``."""
    process = _popen_serve(args, cwd, port)
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines.append(process.stdout.readline())
        if line in lines[-1] or not lines[-1]:
            return process, "".join(lines)
    process.kill()
    raise RuntimeError(f"mcore-serve did not print {line!r}:\n{''.join(lines)}")


def _popen_serve(args: list[str], cwd: Path, port: int) -> subprocess.Popen:
    """``mcore-serve ARGS --port PORT`` started in ``cwd``, its output (with stderr) in ``stdout``."""
    return subprocess.Popen(
        [str(MCORE_SERVE), *args, "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )


def serve_tiny_model(
    directory: Path, timeout: float = 420, extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    """``mcore-serve`` with 2 engine processes (warnings only in its log) serving a tiny model
    written to ``directory/tiny-llama``, once healthy, with ``extra_args`` on its command line;
    ``(process, base URL)``."""
    model_dir = write_tiny_hf_model(directory / "tiny-llama")
    port = find_free_port()
    args = [
        str(model_dir),
        "--data-parallel-size",
        "2",
        "--kv-cache-memory",
        str(KV_CACHE_BYTES),
        *extra_args,
    ]
    process = start_serve([*args, "--log-level", "warning"], directory, port, timeout)
    return process, f"http://127.0.0.1:{port}"


def stop_serve(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    """SIGTERM ``process``; its exit status and output (``TimeoutExpired`` past ``timeout``)."""
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def engine_pids(process: subprocess.Popen) -> list[int]:
    """The process ids of ``mcore-serve``'s engine processes: its children that multiprocessing
    spawned (read from ``/proc``; the resource tracker is left out)."""
    pids = []
    for task in Path(f"/proc/{process.pid}/task").iterdir():
        pids += [int(pid) for pid in (task / "children").read_text().split()]
    return sorted(pid for pid in pids if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}
