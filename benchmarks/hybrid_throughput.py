"""Hybrid throughput: training tokens/s of mcore's ``HybridModel`` against Hugging Face's
``NemotronHForCausalLM`` of the same config and the same weights, and generated tokens/s of
mcore-inference's engine serving the imported model against HF ``generate``.

Training (one process, float32 unless ``--dtype bfloat16``, AdamW with ``foreach=True`` for
both contenders, see ``moe_throughput.py``; a step is forward with the loss, backward, optimizer
step, zeroing the gradients). A seeded random-weight NemotronH with every layer type, pattern
``M*-EM*-E`` (Mamba-2 ``M``, attention ``*``, squared-ReLU MLP ``-``, MoE ``E``): 8 layers,
hidden 256, 4 attention heads / 2 KV heads of head_dim 64, MLP width 1024, Mamba 8 heads x
head_dim 64, 2 groups, state 64, conv 4, chunk 64, 8 routed experts of width 256, top-2 (sigmoid
scores, normalised), one shared expert of width 256, vocab 4096; batch 4 x seq 256 random token
ids (``--quick``: pattern ``M*-E``, hidden 64, head_dim 16, Mamba 4 x 16, state 16, chunk 16, 4
experts of width 64, vocab 512, batch 2 x seq 64). It is saved with ``save_pretrained`` and read
back by ``import_nemotron_h``, so both models hold the same weights; in float32 mcore's logits must
equal HF's (tolerance 1e-4) or nothing is timed. mcore trains in ``model.train()`` on per-token
losses from ``labels`` (``_mcore_step`` of ``train_throughput.py``), HF on ``F.cross_entropy`` of
its logits (``_hf_step``); HF's Mamba mixer runs transformers' reference PyTorch implementation
(``mamba_ssm`` and ``causal_conv1d`` are CUDA packages, not installed here).
The contenders run in interleaved rounds; a figure is the median over rounds of the median step
time, as tokens/s; ``mcore_over_hf`` is HF's step time over mcore's (above 1: mcore is faster).

Inference (bfloat16, greedy, EOS ignored): the same NemotronH, saved in bfloat16, serves the
requests of ``inference_throughput.py``'s ``workload`` (prompts of 32-256 tokens, 32-128 new
tokens; 32 requests, ``--quick`` 4) through mcore's engine (imported by ``import_nemotron_h``,
each request's Mamba state in a slot beside the paged KV cache) and HF ``generate`` in static
batches (``--hf-batch-size``, left padded); that script's runners are reused, so the engine gets
its limits and cache. ``--no-inference`` skips it.

    uv run python benchmarks/hybrid_throughput.py [--quick] [--threads N] [--rounds 3] [--steps 5]

Prints a table, then one JSON line with every figure and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import inference_throughput as serving
import torch
import torch.distributed as dist
from moe_throughput import measure_training
from train_throughput import _hf_step, _mcore_step

TOLERANCE = 1e-4
_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
SHAPE = dict(
    pattern="M*-EM*-E",
    vocab_size=4096,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
    mamba_num_heads=8,
    mamba_head_dim=64,
    n_groups=2,
    ssm_state_size=64,
    chunk_size=64,
    n_routed_experts=8,
    moe_intermediate_size=256,
    moe_shared_expert_intermediate_size=256,
    num_experts_per_tok=2,
)
QUICK_SHAPE = dict(
    pattern="M*-E",
    vocab_size=512,
    hidden_size=64,
    head_dim=16,
    intermediate_size=256,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=16,
    chunk_size=16,
    n_routed_experts=4,
    moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=64,
)


def hf_nemotron_h(shape: dict, dtype: torch.dtype):
    """A seeded random-weight ``NemotronHForCausalLM`` of ``shape`` (its ``pattern`` spelled as
    ``layers_block_type``)."""
    import transformers

    shape = dict(shape)
    types = [_TYPES[symbol] for symbol in shape.pop("pattern")]
    config = transformers.NemotronHConfig(**shape, layers_block_type=types, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.NemotronHForCausalLM(config).to(dtype)


def contenders(args, directory: Path) -> dict[str, tuple]:
    """``{name: (model, step, optimizer, ids, labels)}``: HF and mcore holding the same weights,
    on the same batch (``moe_throughput.measure_training``'s contenders)."""
    from mcore_models.models.hybrid import import_nemotron_h
    from mcore_parallel import ProcessGroupCollection

    dtype = getattr(torch, args.dtype)
    hf = hf_nemotron_h(args.shape, torch.float32)
    hf.save_pretrained(directory)
    mcore = import_nemotron_h(directory, pg_collection=ProcessGroupCollection(tp=dist.new_group([0])))
    generator = torch.Generator().manual_seed(0)
    vocab = args.shape["vocab_size"]
    ids, labels = (torch.randint(0, vocab, (args.batch, args.seq), generator=generator) for _ in range(2))
    check_same_logits(mcore, hf, ids, vocab)  # float32, before any cast
    models = {"hf": (hf.to(dtype), _hf_step), "mcore": (mcore.to(dtype), _mcore_step)}
    return {
        name: (model, step, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), ids, labels)
        for name, (model, step) in models.items()
    }


def measure_inference(args, directory: Path) -> dict:
    """Generated tokens/s of mcore's engine and HF ``generate`` on the same bfloat16 NemotronH."""
    from mcore_models.models.hybrid import import_nemotron_h

    hf_nemotron_h(args.shape, torch.bfloat16).save_pretrained(directory)
    requests = serving.workload(args.requests, vocab_size=args.shape["vocab_size"])
    mcore = serving.run_mcore(directory, requests, "cpu", cuda_graphs=False, import_model=import_nemotron_h)
    result = {
        "dtype": "bfloat16",
        "requests": args.requests,
        "generated_tokens": sum(n for _, n in requests),
        "mcore_tokens_per_s": mcore["tokens_per_s"],
        "hf_tokens_per_s": serving.run_hf(directory, requests, args.hf_batch_size, "cpu"),
        "mcore_steps": mcore["steps"],
    }
    result["mcore_over_hf"] = result["mcore_tokens_per_s"] / result["hf_tokens_per_s"]
    return result


def check_same_logits(mcore, hf, ids: torch.Tensor, vocab: int) -> None:
    """Refuse to time models that compute different things: mcore's float32 logits must be HF's
    (tolerance 1e-4)."""
    mcore.eval()
    hf.eval()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = mcore(ids)[..., :vocab]
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=TOLERANCE, atol=TOLERANCE):
        error = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
        raise SystemExit(
            f"mcore HybridModel's logits differ from HF NemotronH's (max error {error:.2e}, "
            f"shapes {tuple(got.shape)} vs {tuple(expected.shape)}); not timing"
        )
    error = (got - expected).abs().max().item()
    print(f"logits check: max |mcore - HF| = {error:.2e} (tolerance {TOLERANCE:.0e})")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    parser.add_argument("--batch", type=int, default=None, help="training sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=None, help="training sequence length (default 256)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per round (default 5)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="training dtype")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for both contenders")
    parser.add_argument("--requests", type=int, default=None, help="inference requests (default 32)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HF generate's static batch")
    parser.add_argument("--no-inference", action="store_true", help="training figures only")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, small in (("batch", 4, 2), ("seq", 256, 64), ("steps", 5, 2), ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.warmup = 1 if quick else args.warmup
    args.requests = args.requests or (4 if quick else 32)
    args.shape = SHAPE | (QUICK_SHAPE if quick else {})
    return args


def print_table(seconds: dict[str, float], tokens: int, inference: dict | None) -> None:
    names = {"hf": "HF NemotronHForCausalLM", "mcore": "mcore HybridModel"}
    print(f"{'training (fwd+bwd+AdamW)':<32}{'step [ms]':>11}{'tokens/s':>11}{'vs HF':>8}")
    for name, s in seconds.items():
        print(f"{names[name]:<32}{s * 1e3:>11.1f}{tokens / s:>11.0f}{seconds['hf'] / s:>8.2f}")
    print("(vs HF: HF's step time over this one's; above 1 is faster than HF)")
    if inference is None:
        print("inference: skipped (--no-inference)")
        return
    print(f"\n{'inference (bf16, greedy)':<32}{'tokens/s':>11}{'mcore ratio':>13}")
    for label, key in (("mcore-inference", "mcore"), ("HF generate (static)", "hf")):
        value = inference[f"{key}_tokens_per_s"]
        print(f"{label:<32}{value:>11.1f}{inference['mcore_tokens_per_s'] / value:>13.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        models = contenders(args, Path(tmp))
        inference = None if args.no_inference else measure_inference(args, Path(tmp) / "serve")
    parameters = {name: sum(p.numel() for p in entry[0].parameters()) for name, entry in models.items()}
    seconds = measure_training(models, args)
    tokens = args.batch * args.seq
    result = {
        "benchmark": "hybrid_throughput",
        "quick": args.quick,
        "threads": args.threads,
        "training": {
            "dtype": args.dtype,
            "batch": args.batch,
            "seq": args.seq,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "shape": args.shape,
            "mcore_parameters": parameters["mcore"],
            "hf_parameters": parameters["hf"],
            "mcore_step_ms": seconds["mcore"] * 1e3,
            "hf_step_ms": seconds["hf"] * 1e3,
            "mcore_tokens_per_s": tokens / seconds["mcore"],
            "hf_tokens_per_s": tokens / seconds["hf"],
            "mcore_over_hf": seconds["hf"] / seconds["mcore"],
        },
        "inference": inference,
    }
    print_table(seconds, tokens, inference)
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
