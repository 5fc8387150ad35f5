"""mcore-fsdp against ``torch.distributed.fsdp.fully_shard`` (FSDP2): step time and peak memory.

Same model (8 residual MLP blocks, about 50M parameters, FP32), same data, same AdamW, 2 ranks on
gloo. Each configuration runs in freshly forked ranks, one thread each. The configurations run
in interleaved rounds; a configuration's step time is the smallest over rounds of its median step
time (the machine may be shared: the minimum is the figure least disturbed by other load), its
memory the largest over rounds.

Peak memory is measured from each rank's resident set size (RSS, ``/proc/self/status``), not
from an allocator's counters, so it covers every byte the rank really holds. Before the model is
built the rank records its RSS (the interpreter, torch and gloo: the baseline). After setup
(model built and sharded, optimizer created, warm-up steps done) the RSS high-water mark
``VmHWM`` is reset through ``/proc/self/clear_refs``; after the measured steps it is read again.
``peak_mib`` = high-water mark during the measured steps minus the baseline: parameters,
gradients, optimizer state and all transient buffers. ``transient_mib`` = the same peak minus the
RSS at the reset: what a step adds on top of the resident state. glibc is told (``mallopt``) to
serve every allocation above 128 KiB with ``mmap``, so freed tensors really leave the resident
set instead of lingering in the heap.

    uv run python benchmarks/fsdp_vs_fsdp2.py [--steps 4] [--warmup 2] [--dim 896] [--batch 128]

Prints a readable table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WORLD_SIZE = 2
DEPTH = 8
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_M_MMAP_THRESHOLD = -3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(DEPTH))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _shard(model: nn.Module, implementation: str, mesh) -> nn.Module:
    """The same calls for both: each block, then the root."""
    if implementation == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from mcore_fsdp import fully_shard as mcore_fully_shard

        fully_shard = functools.partial(mcore_fully_shard, strategy=implementation)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _rank(rank: int, store_path: str, implementation: str, args, results) -> None:
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    baseline_kib = _status_kib("VmRSS")
    torch.manual_seed(0)
    model = _shard(Model(args.dim), implementation, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(index: int) -> float:
        generator = torch.Generator().manual_seed(index)
        inputs = torch.randn(WORLD_SIZE * args.batch, args.dim, generator=generator).chunk(WORLD_SIZE)[rank]
        targets = torch.randn(WORLD_SIZE * args.batch, args.dim, generator=generator).chunk(WORLD_SIZE)[rank]
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for index in range(args.warmup):
        step(index)
    dist.barrier()
    resident_kib = _status_kib("VmRSS")
    _reset_peak()
    times, losses = [], []
    for index in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(index))
        times.append(time.perf_counter() - start)
    peak_kib = _status_kib("VmHWM")
    results.put(
        (
            rank,
            {
                "step_s": statistics.median(times),
                "peak_mib": (peak_kib - baseline_kib) / 1024,
                "transient_mib": (peak_kib - resident_kib) / 1024,
                "last_loss": losses[-1],
            },
        )
    )
    dist.destroy_process_group()


def _run(implementation: str, args) -> dict:
    context = mp.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        store_path = str(Path(workdir) / "store")
        ranks = [
            context.Process(target=_rank, args=(rank, store_path, implementation, args, results))
            for rank in range(WORLD_SIZE)
        ]
        for process in ranks:
            process.start()
        per_rank = dict(results.get(timeout=args.timeout) for _ in ranks)
        for process in ranks:
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"{implementation}: a rank exited with {process.exitcode}")
    return {
        "step_s": max(per_rank[rank]["step_s"] for rank in per_rank),
        "peak_mib_per_rank": [round(per_rank[rank]["peak_mib"], 1) for rank in sorted(per_rank)],
        "transient_mib_per_rank": [round(per_rank[rank]["transient_mib"], 1) for rank in sorted(per_rank)],
        "last_loss": per_rank[0]["last_loss"],
    }


def _combine(rounds: list[dict]) -> dict:
    """Fastest round's step time, largest memory figures per rank over the rounds."""
    return {
        "step_s": min(result["step_s"] for result in rounds),
        "step_s_rounds": [round(result["step_s"], 3) for result in rounds],
        "peak_mib_per_rank": [
            max(values) for values in zip(*(r["peak_mib_per_rank"] for r in rounds), strict=True)
        ],
        "transient_mib_per_rank": [
            max(values) for values in zip(*(r["transient_mib_per_rank"] for r in rounds), strict=True)
        ],
        "last_loss": rounds[0]["last_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=896, help="model width (896: about 52M parameters)")
    parser.add_argument("--batch", type=int, default=128, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=4, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all configurations")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    args = parser.parse_args()
    strategies = tuple(args.strategies)

    parameters = sum(p.numel() for p in Model(args.dim).parameters())
    rounds: dict[str, list[dict]] = {name: [] for name in ("fsdp2", *strategies)}
    for _ in range(args.rounds):
        for name in rounds:
            rounds[name].append(_run(name, args))
    runs = {name: _combine(results) for name, results in rounds.items()}
    peer = runs["fsdp2"]
    report = {
        "benchmark": "fsdp_vs_fsdp2",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "device": "cpu",
        "parameters": parameters,
        "blocks": DEPTH,
        "dtype": "float32",
        "batch_per_rank": args.batch,
        "measured_steps": args.steps,
        "rounds": args.rounds,
        "memory": "per-rank RSS high-water mark (VmHWM) during the measured steps minus RSS before the model "
        "was built (peak); minus RSS after warm-up (transient)",
        "fsdp2": peer,
        "mcore_fsdp": {
            strategy: {
                **runs[strategy],
                "step_ratio": round(runs[strategy]["step_s"] / peer["step_s"], 3),
                "memory_ratio": round(
                    max(runs[strategy]["peak_mib_per_rank"]) / max(peer["peak_mib_per_rank"]), 3
                ),
                "transient_ratio": round(
                    max(runs[strategy]["transient_mib_per_rank"]) / max(peer["transient_mib_per_rank"]), 3
                ),
            }
            for strategy in strategies
        },
    }
    header = f"{'configuration':<30}{'step s':>9}{'peak MiB/rank':>16}{'transient MiB/rank':>20}{'step x':>8}{'peak x':>8}"
    print(f"{parameters / 1e6:.1f}M parameters, {DEPTH} blocks, {WORLD_SIZE} ranks on gloo, FP32 AdamW")
    print(header)
    print("-" * len(header))
    rows = [("FSDP2 fully_shard", peer, None)] + [
        (f"mcore-fsdp {strategy}", runs[strategy], report["mcore_fsdp"][strategy]) for strategy in strategies
    ]
    for name, run, ratios in rows:
        peak = "/".join(f"{value:.0f}" for value in run["peak_mib_per_rank"])
        transient = "/".join(f"{value:.0f}" for value in run["transient_mib_per_rank"])
        step_ratio = f"{ratios['step_ratio']:.2f}" if ratios else "1.00"
        memory_ratio = f"{ratios['memory_ratio']:.2f}" if ratios else "1.00"
        print(f"{name:<30}{run['step_s']:>9.3f}{peak:>16}{transient:>20}{step_ratio:>8}{memory_ratio:>8}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
