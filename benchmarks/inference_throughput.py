"""Generated tokens/s of mcore-inference's engine against Hugging Face ``generate`` (static
batches) and, when installed in another environment, vLLM's CPU build; same random-weight Llama
(hidden 512, 8 layers, 8 heads, 4 KV heads, head_dim 64, vocab 32000, bf16), same requests.

    uv run python benchmarks/inference_throughput.py [--quick] [--device cuda [--cuda-graphs]]

vLLM: set ``MCORE_BENCH_VLLM_PYTHON`` to the python of an environment with vLLM's CPU build; the
script runs the same workload there in a subprocess (``--vllm-worker``). Without it, vLLM is
reported as skipped. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=512,
)


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``count`` (prompt, output length) pairs: prompts of 32-256 tokens, outputs of 32-128."""
    import random

    rng = random.Random(seed)
    return [
        ([rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
        for _ in range(count)
    ]


def save_model(directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL, torch_dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(directory)


def run_mcore(directory: Path, requests, device: str, cuda_graphs: bool) -> float:
    import torch
    import torch.distributed as dist
    from mcore_inference import DynamicInferenceEngine, SamplingParams
    from mcore_models import import_hf_checkpoint
    from mcore_parallel import ProcessGroupCollection

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = import_hf_checkpoint(directory, pg_collection=ProcessGroupCollection(tp=dist.new_group([0])))
    model.to(device=device, dtype=torch.bfloat16)
    engine = DynamicInferenceEngine(
        model,
        kv_cache_memory=2 << 30,
        block_size=16,
        max_requests=64,
        max_tokens=512,
        cuda_graphs=cuda_graphs,
    )
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, num_tokens_to_generate=2))  # warm-up
    start = time.perf_counter()
    done = engine.generate(
        [p for p, _ in requests],
        [SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=n) for _, n in requests],
    )
    elapsed = time.perf_counter() - start
    return sum(len(r.generated_tokens) for r in done) / elapsed


def run_hf(directory: Path, requests, batch_size: int, device: str) -> float:
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
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


def run_vllm(directory: Path, requests) -> float:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(directory), dtype="bfloat16", max_model_len=512, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests instead of 64 (smoke run)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cuda-graphs", action="store_true", help="mcore decode steps through CUDA graphs")
    parser.add_argument("--vllm-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    count = args.requests or (8 if args.quick else 64)
    requests = workload(count)
    if args.vllm_worker:
        print(json.dumps({"tokens_per_s": run_vllm(args.vllm_worker, requests)}))
        return

    import torch

    torch.set_num_threads(args.threads)
    results: dict[str, object] = {
        "benchmark": "inference_throughput",
        "requests": count,
        "generated_tokens": sum(n for _, n in requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "threads": args.threads,
        "device": args.device,
        "cuda_graphs": args.cuda_graphs,
    }
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_model(directory)
        results["mcore_tokens_per_s"] = run_mcore(directory, requests, args.device, args.cuda_graphs)
        results["hf_tokens_per_s"] = run_hf(directory, requests, args.hf_batch_size, args.device)
        vllm_python = os.environ.get("MCORE_BENCH_VLLM_PYTHON")
        if vllm_python:
            command = [vllm_python, __file__, "--vllm-worker", str(directory), "--requests", str(count)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results["vllm_tokens_per_s"] = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
        else:
            results["vllm_tokens_per_s"] = None
            results["vllm_skipped"] = (
                "set MCORE_BENCH_VLLM_PYTHON to the python of an environment with vLLM (CPU build)"
            )
    results["mcore_over_hf"] = results["mcore_tokens_per_s"] / results["hf_tokens_per_s"]
    vllm = results["vllm_tokens_per_s"]
    results["mcore_over_vllm"] = results["mcore_tokens_per_s"] / vllm if vllm else None

    print(f"{'engine':<22}{'generated tokens/s':>20}{'mcore ratio':>14}")
    for name, key in (("mcore-inference", "mcore"), ("HF generate (static)", "hf"), ("vLLM CPU", "vllm")):
        value = results[f"{key}_tokens_per_s"]
        if value is None:
            print(f"{name:<22}{'skipped':>20}{'':>14}")
        else:
            print(f"{name:<22}{value:>20.1f}{results['mcore_tokens_per_s'] / value:>14.2f}")
    if results.get("vllm_skipped"):
        print(f"vLLM skipped: {results['vllm_skipped']}")
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
