"""Training tokens/s: mcore's ``GPTModel`` against Hugging Face ``LlamaForCausalLM`` of the same config.

One process, the same batch of random token ids, the same dtype and the same AdamW; a step is
forward with the loss, backward, optimizer step and zeroing the gradients. The model is
``mcore-train``'s default (4 layers, hidden 256, 4 heads, SwiGLU 688, RMSNorm, RoPE, vocab 4096)
unless told otherwise. The two models run in interleaved rounds; each one's figure is the best
over rounds of its median step time (the machine may be shared: the minimum is the least
disturbed), converted to tokens/s.

    uv run python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 5] [--rounds 3]

Prints a readable table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = initialize_model_parallel()
    config = TrainModelConfig(bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)
    mcore = GPTModel(config, args.vocab, pg_collection=groups)
    hf_config = HF_MAPPINGS["llama"]().config_to_hf(config, args.vocab)
    hf_config["max_position_embeddings"] = max(args.seq, hf_config["max_position_embeddings"])
    hf = LlamaForCausalLM(LlamaConfig(**hf_config, attn_implementation="sdpa")).to(dtype)
    models = {
        "mcore": (mcore, _mcore_step, torch.optim.AdamW(mcore.parameters(), lr=1e-4)),
        "hf": (hf, _hf_step, torch.optim.AdamW(hf.parameters(), lr=1e-4)),
    }
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    best = {name: float("inf") for name in models}
    for _ in range(args.rounds):
        for name, (model, step, optimizer) in models.items():
            model.train()
            for _ in range(args.warmup):
                step(model, optimizer, ids, labels)
            seconds = _median_step_seconds(step, model, optimizer, ids, labels, args.steps)
            best[name] = min(best[name], seconds)
    tokens = args.batch * args.seq
    result = {
        "benchmark": "train_throughput",
        "model": "mcore-train default (4 layers, hidden 256, 4 heads, swiglu 688, vocab 4096)",
        "parameters": sum(p.numel() for p in mcore.parameters()),
        "hf_parameters": sum(p.numel() for p in hf.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "threads": args.threads,
        "mcore_tokens_per_s": tokens / best["mcore"],
        "hf_tokens_per_s": tokens / best["hf"],
        "ratio": best["hf"] / best["mcore"],
    }
    print(f"{'model':<28}{'step [ms]':>12}{'tokens/s':>12}")
    print(f"{'mcore GPTModel':<28}{best['mcore'] * 1e3:>12.1f}{result['mcore_tokens_per_s']:>12.0f}")
    print(f"{'HF LlamaForCausalLM (sdpa)':<28}{best['hf'] * 1e3:>12.1f}{result['hf_tokens_per_s']:>12.0f}")
    print(f"ratio mcore / HF: {result['ratio']:.2f}x")
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
