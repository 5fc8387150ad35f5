"""Training tokens/s and peak memory: mcore's ``GPTModel`` against Hugging Face ``LlamaForCausalLM`` of the same config.

One process, the same batch of random token ids, the same dtype and the same AdamW; a step is
forward with the loss, backward, optimizer step and zeroing the gradients. The model is
``mcore-train``'s default shape at hidden 256 (4 layers, 4 heads, SwiGLU 688, RMSNorm, RoPE, vocab
4096; the default run itself now trains hidden 128, which more tokens a second serve better in
its time budget), unless told otherwise. Three contenders run in interleaved rounds: ``GPTModel`` (eager, its loss
from per-token losses), HF eager (SDPA attention, ``F.cross_entropy`` on its logits) and the same
HF model under ``torch.compile`` (default inductor; compiled during its first warm-up, the compile
time is reported apart). Each one's figure is the median over rounds of its median step time
(the machine may be shared: alternating rounds spread disturbances over all), converted to
tokens/s; ``ratio`` is HF eager's step time over ``GPTModel``'s (above 1: mcore is faster).

Peak memory per step: each eager model is measured in a fresh subprocess of this script (so the
other model's allocations and the allocator's history do not count), after ``--warmup`` steps
(the optimizer's state exists, every code path has run). There ``malloc_trim(0)`` hands the heap
that glibc keeps after frees back to the OS, writing ``5`` to ``/proc/self/clear_refs`` resets the
kernel's resident-set high-water mark (Linux >= 4.0), then one step runs and ``VmHWM`` from
``/proc/self/status`` is read. ``peak_step_mib`` is that high-water mark minus the resident set
just before the step: the most memory the step held at once beyond what lives between steps
(parameters, optimizer state; gradients are set to ``None``), i.e. activations, logits, gradients
and temporaries, counted in resident pages as the OS sees them (``tracemalloc`` does not see
tensor storage; ``ru_maxrss`` cannot be reset). Pages an allocation reserves but never touches do
not count, and glibc may reuse freed pages within the step, so this is what the step really
occupies, not the sum of its allocations. ``peak_rss_mib`` is the absolute high-water mark of the
process during that step. On a system without ``/proc/self/clear_refs`` the memory figures are
``null``.

    uv run python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 5] [--rounds 3] [--no-compile]

Prints a readable table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from mcore_models import HF_MAPPINGS, GPTModel
from mcore_models.training import TrainModelConfig
from mcore_parallel import initialize_model_parallel


def _mcore_step(model, optimizer, ids, labels):
    loss = model(ids, labels=labels).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _hf_step(model, optimizer, ids, labels):
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _median_step_seconds(step, model, optimizer, ids, labels, steps: int) -> float:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step(model, optimizer, ids, labels)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true", help="skip HF under torch.compile")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-of", choices=["mcore", "hf"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _build(args, which: str):
    """The model ``which`` ("mcore" or "hf"), seeded alike, and the batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    config = TrainModelConfig(hidden_size=256, ffn_hidden_size=688, bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)
    if which == "mcore":
        model = GPTModel(config, args.vocab, pg_collection=initialize_model_parallel())
    else:
        hf_config = HF_MAPPINGS["llama"]().config_to_hf(config, args.vocab)
        hf_config["max_position_embeddings"] = max(args.seq, hf_config["max_position_embeddings"])
        model = LlamaForCausalLM(LlamaConfig(**hf_config, attn_implementation="sdpa")).to(dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    return model, ids, labels


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _measure_memory(args) -> dict:
    """In this (fresh) process: one step's peak resident memory, see the module docstring."""
    model, ids, labels = _build(args, args.memory_of)
    step = _mcore_step if args.memory_of == "mcore" else _hf_step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for _ in range(max(args.warmup, 1)):
        step(model, optimizer, ids, labels)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return {"peak_step_mib": None, "peak_rss_mib": None}
    before = _read_status_kib("VmRSS")
    step(model, optimizer, ids, labels)
    peak = _read_status_kib("VmHWM")
    return {"peak_step_mib": (peak - before) / 1024, "peak_rss_mib": peak / 1024}


def _memory_in_subprocess(which: str) -> dict:
    argv = [sys.executable, __file__, *sys.argv[1:], "--memory-of", which]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if args.memory_of:
        print(json.dumps(_measure_memory(args)))
        dist.destroy_process_group()
        return

    mcore, ids, labels = _build(args, "mcore")
    hf, _, _ = _build(args, "hf")
    contenders = {
        "mcore": (mcore, _mcore_step, torch.optim.AdamW(mcore.parameters(), lr=1e-4)),
        "hf": (hf, _hf_step, torch.optim.AdamW(hf.parameters(), lr=1e-4)),
    }
    compile_seconds = compile_error = None
    if not args.no_compile:
        hf_compiled = copy.deepcopy(hf)
        optimizer = torch.optim.AdamW(hf_compiled.parameters(), lr=1e-4)
        compiled = torch.compile(hf_compiled)
        began = time.perf_counter()
        try:
            _hf_step(compiled, optimizer, ids, labels)
            compile_seconds = time.perf_counter() - began
            contenders["hf_compiled"] = (compiled, _hf_step, optimizer)
        except Exception as error:  # report, do not fail the eager comparison
            compile_error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    rounds = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (model, step, optimizer) in contenders.items():
            model.train()
            for _ in range(args.warmup):
                step(model, optimizer, ids, labels)
            rounds[name].append(_median_step_seconds(step, model, optimizer, ids, labels, args.steps))
    seconds = {name: statistics.median(times) for name, times in rounds.items()}
    memory = {"mcore": {}, "hf": {}}
    if not args.no_memory:
        memory = {name: _memory_in_subprocess(name) for name in memory}
    tokens = args.batch * args.seq
    result = {
        "benchmark": "train_throughput",
        "model": "4 layers, hidden 256, 4 heads, swiglu 688, vocab 4096",
        "parameters": sum(p.numel() for p in mcore.parameters()),
        "hf_parameters": sum(p.numel() for p in hf.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "threads": args.threads,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "mcore_tokens_per_s": tokens / seconds["mcore"],
        "hf_tokens_per_s": tokens / seconds["hf"],
        "hf_compiled_tokens_per_s": tokens / seconds["hf_compiled"] if "hf_compiled" in seconds else None,
        "hf_compile_seconds": compile_seconds,
        "hf_compile_error": compile_error,
        "ratio": seconds["hf"] / seconds["mcore"],
        "ratio_vs_hf_compiled": seconds["hf_compiled"] / seconds["mcore"]
        if "hf_compiled" in seconds
        else None,
        "mcore_peak_step_mib": memory["mcore"].get("peak_step_mib"),
        "hf_peak_step_mib": memory["hf"].get("peak_step_mib"),
        "mcore_peak_rss_mib": memory["mcore"].get("peak_rss_mib"),
        "hf_peak_rss_mib": memory["hf"].get("peak_rss_mib"),
    }
    names = {"mcore": "mcore GPTModel", "hf": "HF Llama (sdpa)", "hf_compiled": "HF Llama torch.compile"}
    print(f"{'model':<26}{'step [ms]':>11}{'tokens/s':>10}{'peak/step [MiB]':>17}{'peak RSS [MiB]':>16}")
    for name, step_seconds in seconds.items():
        mem = memory.get(name, {})
        step_mib = "-" if mem.get("peak_step_mib") is None else f"{mem['peak_step_mib']:.1f}"
        rss_mib = "-" if mem.get("peak_rss_mib") is None else f"{mem['peak_rss_mib']:.0f}"
        print(
            f"{names[name]:<26}{step_seconds * 1e3:>11.1f}{tokens / step_seconds:>10.0f}{step_mib:>17}{rss_mib:>16}"
        )
    print(f"ratio mcore / HF eager: {result['ratio']:.2f}x")
    if result["ratio_vs_hf_compiled"] is not None:
        print(
            f"ratio mcore / HF compiled: {result['ratio_vs_hf_compiled']:.2f}x (compile {compile_seconds:.0f} s)"
        )
    elif compile_error:
        print(f"HF under torch.compile failed: {compile_error}")
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
