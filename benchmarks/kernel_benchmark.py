"""mcore-kernels against PyTorch eager, ``torch.compile`` and Liger-Kernel, op by op, on a GPU.

For every op of mcore-kernels (norms, RoPE, MLP activations, the attention softmax, MoE routing and
permutation, the paged KV-cache append and paged attention, cross entropy; ``kernel_cases``) at a transformer's
sizes in bfloat16, each contender runs on the same inputs: ``triton`` (mcore-kernels' Triton
kernel), ``eager`` (its PyTorch reference), ``compile`` (that reference under ``torch.compile``,
compiled during warm-up) and ``liger`` (Liger-Kernel's op where it has one and is installed:
``uv sync --group benchmarks``). Per contender: the median forward time, the median backward time
(forward and backward, less forward) and the peak memory allocated during a forward and backward
beyond the inputs, from CUDA events and the caching allocator's statistics. A contender that fails
reports its error instead of figures.

    uv run python benchmarks/kernel_benchmark.py [--repeats 20] [--no-compile] [--ops rms_norm,swiglu]

Prints a table on stderr and one JSON line on stdout. Without a GPU it says so and exits 0.

(Not ``kernels.py``: transformers probes for the Hugging Face ``kernels`` package by importing
``kernels``, and a ``kernels.py`` here shadowed it for every benchmark run from this folder.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from kernel_cases import Case, all_cases, on_backend, output_tensors


def _gradients(case: Case) -> list[torch.Tensor]:
    return [t for t in case.inputs.values() if t.requires_grad] if case.backward else []


def _step(run, case: Case, backward: bool) -> None:
    outputs = output_tensors(run(**case.inputs))
    if backward:
        grads = _gradients(case)
        torch.autograd.grad(outputs, grads, [torch.ones_like(t) for t in outputs], allow_unused=True)


def _median_ms(run, case: Case, backward: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(run, case, backward)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(run, case: Case, repeats: int) -> dict:
    """Forward and backward milliseconds and peak MiB of ``run`` on ``case``'s inputs."""
    backward = bool(_gradients(case))
    for _ in range(3):  # warm-up: compiles Triton kernels and torch.compile graphs
        _step(run, case, backward)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(run, case, backward)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    forward = _median_ms(run, case, False, repeats)
    result = {"forward_ms": round(forward, 4), "peak_mib": round(peak, 2)}
    if backward:
        result["backward_ms"] = round(_median_ms(run, case, True, repeats) - forward, 4)
    return result


def contenders(case: Case, compile_reference: bool) -> dict:
    """The ways to compute ``case``: mcore's Triton kernel, its reference eager and compiled, Liger."""
    runs = {"triton": on_backend("triton", case.run), "eager": on_backend("reference", case.run)}
    if compile_reference:
        runs["compile"] = on_backend("reference", torch.compile(case.run, dynamic=False))
    if case.liger is not None:
        runs["liger"] = case.liger
    return runs


def run_case(case: Case, repeats: int, compile_reference: bool) -> dict:
    """Every contender's figures for ``case`` (or its error), and each one's forward time over
    mcore Triton's (above 1: Triton is faster)."""
    figures = {}
    for name, run in contenders(case, compile_reference).items():
        try:
            figures[name] = measure(run, case, repeats)
        except Exception as error:  # a peer that cannot run this op here: say why, keep going
            figures[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        if name == "compile":
            torch._dynamo.reset()  # its graphs were for this op's shapes only
    triton = figures.get("triton", {}).get("forward_ms")
    for name, result in figures.items():
        if triton and "forward_ms" in result and name != "triton":
            result["forward_ratio_to_triton"] = round(result["forward_ms"] / triton, 3)
    return figures


def _table(report: dict) -> str:
    lines = [f"{'op':<32}{'contender':<10}{'fwd ms':>10}{'bwd ms':>10}{'peak MiB':>10}"]
    for op, figures in report["ops"].items():
        for name, result in figures.items():
            if "error" in result:
                lines.append(f"{op:<32}{name:<10}  {result['error'][:60]}")
                continue
            backward = result.get("backward_ms")
            lines.append(
                f"{op:<32}{name:<10}{result['forward_ms']:>10.3f}"
                f"{'' if backward is None else f'{backward:.3f}':>10}{result['peak_mib']:>10.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per contender (median)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernel_benchmark.py needs a CUDA GPU (kernel timings are taken on a GPU only); none here"
        )
        return 0
    wanted = {name for name in args.ops.split(",") if name}
    cases = [case for case in all_cases("cuda", torch.bfloat16) if not wanted or case.name in wanted]
    report = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "torch": torch.__version__,
        "ops": {case.name: run_case(case, args.repeats, not args.no_compile) for case in cases},
    }
    print(_table(report), file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
