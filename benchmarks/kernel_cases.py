"""What ``benchmarks/kernel_benchmark.py`` measures: per op of mcore-kernels, its inputs at a transformer's
sizes and the contenders that compute it: ``triton`` (mcore-kernels' kernel), ``eager`` (its
PyTorch reference), ``compile`` (that reference under ``torch.compile``) and ``liger`` (Liger-Kernel's
op, where it has one and is importable)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mcore_kernels import (
    apply_rotary,
    attention_softmax,
    cross_entropy,
    geglu,
    layer_norm,
    linear_cross_entropy,
    moe_permute,
    moe_topk_routing,
    moe_unpermute,
    paged_attention,
    paged_decode_attention,
    paged_kv_append,
    rms_norm,
    rope_cos_sin,
    rope_inverse_frequencies,
    squared_relu,
    swiglu,
    use_backend,
)


@dataclass
class Case:
    """One op: ``inputs`` (those requiring grad get gradients when ``backward``), ``run`` (the
    mcore call on them), and peers' calls on the same inputs (``liger``)."""

    name: str
    inputs: dict[str, torch.Tensor]
    run: Callable[..., torch.Tensor]
    backward: bool = True
    liger: Callable[..., torch.Tensor] | None = None


def on_backend(backend: str, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``run`` with mcore-kernels forced to ``backend`` for its calls."""

    def call(**inputs):
        with use_backend(backend):
            return run(**inputs)

    return call


def _liger(module: str, function: str):
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), function)
    except Exception:  # not installed, or an API this version does not have
        return None


def _random(shape, device, dtype, *, grad=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, dtype).requires_grad_(grad)


def elementwise_cases(device, dtype, tokens: int, hidden: int) -> list[Case]:
    """Norms and MLP activations over ``[tokens, hidden]``."""
    x = _random((tokens, hidden), device, dtype)
    weight, bias = _random((hidden,), device, dtype, seed=1), _random((hidden,), device, dtype, seed=2)
    fc1 = _random((tokens, 2 * hidden), device, dtype, seed=3)
    liger_rms = _liger("rms_norm", "LigerRMSNormFunction")
    liger_ln = _liger("layer_norm", "LigerLayerNormFunction")
    liger_silu = _liger("swiglu", "LigerSiLUMulFunction")
    liger_gelu = _liger("geglu", "LigerGELUMulFunction")
    liger_relu2 = _liger("relu_squared", "LigerReLUSquaredFunction")
    gate_up = lambda fc1: fc1.chunk(2, dim=-1)  # noqa: E731
    return [
        Case(
            "rms_norm",
            {"x": x, "weight": weight},
            lambda x, weight: rms_norm(x, weight, 1e-6),
            liger=liger_rms and (lambda x, weight: liger_rms.apply(x, weight, 1e-6, 0.0, "llama", False)),
        ),
        Case(
            "layer_norm",
            {"x": x, "weight": weight, "bias": bias},
            lambda x, weight, bias: layer_norm(x, weight, bias, 1e-5),
            liger=liger_ln and (lambda x, weight, bias: liger_ln.apply(x, weight, bias, 1e-5)),
        ),
        Case(
            "swiglu",
            {"fc1": fc1},
            lambda fc1: swiglu(fc1),
            liger=liger_silu and (lambda fc1: liger_silu.apply(*gate_up(fc1))),
        ),
        Case(
            "geglu",
            {"fc1": fc1},
            lambda fc1: geglu(fc1),
            liger=liger_gelu and (lambda fc1: liger_gelu.apply(*gate_up(fc1))),
        ),
        Case(
            "squared_relu",
            {"x": x},
            lambda x: squared_relu(x),
            liger=liger_relu2 and (lambda x: liger_relu2.apply(x)),
        ),
    ]


def attention_cases(device, dtype, seq: int, batch: int, heads: int, dim: int) -> list[Case]:
    """RoPE on queries and keys ``[s, b, n, d]`` and the attention softmax over ``[b, n, s, s]``."""
    q, k = (
        _random((seq, batch, heads, dim), device, dtype),
        _random((seq, batch, heads, dim), device, dtype, seed=1),
    )
    cos, sin = rope_cos_sin(torch.arange(seq), rope_inverse_frequencies(dim, 10000.0))
    cos, sin = cos.to(device, dtype), sin.to(device, dtype)
    scores = _random((batch, heads, seq, seq), device, dtype, seed=2)
    sinks = torch.zeros(heads, device=device)
    liger_rope = _liger("rope", "LigerRopeFunction")
    liger_softmax = _liger("softmax", "LigerSoftmaxFunction")

    def mcore_rope(q, k):
        table = (cos[:, None, None], sin[:, None, None])
        return apply_rotary(q, *table), apply_rotary(k, *table)

    def liger_rope_call(q, k):  # Liger's layout: [b, n, s, d] and tables [1, s, d]
        qt, kt = q.permute(1, 2, 0, 3).contiguous(), k.permute(1, 2, 0, 3).contiguous()
        return liger_rope.apply(qt, kt, cos[None], sin[None])

    return [
        Case("rope", {"q": q, "k": k}, mcore_rope, liger=liger_rope and liger_rope_call),
        Case(
            "softmax",
            {"scores": scores},
            lambda scores: attention_softmax(scores, scale=dim**-0.5),
            liger=liger_softmax and (lambda scores: liger_softmax.apply(scores * dim**-0.5)),
        ),
        Case(
            "softmax_causal_window_sink",
            {"scores": scores},
            lambda scores: attention_softmax(
                scores, scale=dim**-0.5, causal=True, window_size=seq // 4, sink_logits=sinks
            ),
        ),
    ]


def moe_cases(device, dtype, tokens: int, hidden: int, experts: int, topk: int) -> list[Case]:
    """Top-k routing of ``[tokens, experts]`` logits and the permutation of ``[tokens, hidden]``."""
    logits = _random((tokens, experts), device, torch.float32)
    hidden_states = _random((tokens, hidden), device, dtype, seed=1)
    with torch.no_grad():
        _, indices, _ = moe_topk_routing(logits.detach(), topk)
    order = torch.argsort(indices.flatten(), stable=True)
    row_map = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    row_map = row_map.view(tokens, topk)
    probs = _random((tokens, topk), device, torch.float32, seed=2).softmax(-1).detach().requires_grad_()
    rows = _random((tokens * topk, hidden), device, dtype, seed=3)
    return [
        Case("moe_topk_routing", {"logits": logits}, lambda logits: moe_topk_routing(logits, topk)[0]),
        Case(
            "moe_permute",
            {"hidden": hidden_states},
            lambda hidden: moe_permute(hidden, row_map, tokens * topk),
        ),
        Case(
            "moe_unpermute",
            {"rows": rows, "probs": probs},
            lambda rows, probs: moe_unpermute(rows, row_map, probs),
        ),
    ]


def paged_cases(
    device, dtype, batch: int, context: int, chunk: int, heads: int, groups: int, dim: int
) -> list[Case]:
    """Forward-only inference ops over a paged cache of 16-token blocks: appending a decode step's
    keys, decode attention of ``batch`` rows at ``context`` keys, a prefill chunk of ``chunk``
    queries after ``context - chunk`` cached keys per sequence."""
    block_size = 16
    width = -(-context // block_size)
    generator = torch.Generator().manual_seed(0)
    table = torch.randperm(batch * width, generator=generator).view(batch, width).to(device)
    caches = [
        _random((batch * width, block_size, groups, dim), device, dtype, grad=False, seed=s) for s in (1, 2)
    ]
    new = [_random((batch, groups, dim), device, dtype, grad=False, seed=s) for s in (3, 4)]
    slots = (table[:, -1] * block_size).contiguous()
    decode_query = _random((batch, heads, dim), device, dtype, grad=False, seed=5)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    chunk_query = _random((batch * chunk, heads, dim), device, dtype, grad=False, seed=6)
    starts = torch.arange(batch + 1, device=device) * chunk
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    scale = dim**-0.5
    return [
        Case(
            "paged_kv_append",
            {"key": new[0], "value": new[1]},
            lambda key, value: paged_kv_append(*caches, key, value, slots),
            backward=False,
        ),
        Case(
            "paged_decode_attention",
            {"query": decode_query},
            lambda query: paged_decode_attention(query, *caches, table, positions, scale=scale),
            backward=False,
        ),
        Case(
            "paged_attention_prefill_chunk",
            {"query": chunk_query},
            lambda query: paged_attention(
                query, *caches, table, starts, seq_lens, scale=scale, max_query_len=chunk
            ),
            backward=False,
        ),
    ]


def cross_entropy_cases(device, dtype, tokens: int, hidden: int, vocab: int) -> list[Case]:
    """Cross entropy of given logits, and fused with the output layer (mean over the tokens)."""
    liger_fused = _liger("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")
    liger_ce = _liger("cross_entropy", "LigerCrossEntropyFunction")
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    hidden_states = _random((tokens, hidden), device, dtype)
    weight = _random((vocab, hidden), device, dtype, seed=1)
    logits = _random((tokens, vocab), device, torch.float32, seed=2)
    return [
        Case(
            "linear_cross_entropy",
            {"hidden": hidden_states, "weight": weight},
            lambda hidden, weight: linear_cross_entropy(hidden, weight, target),
            liger=liger_fused and (lambda hidden, weight: liger_fused.apply(hidden, weight, target)[0]),
        ),
        Case(
            "cross_entropy",
            {"logits": logits},
            lambda logits: cross_entropy(logits, target),
            liger=liger_ce and (lambda logits: liger_ce.apply(logits, target, None)[0]),
        ),
    ]


def all_cases(device, dtype, *, small: bool = False) -> list[Case]:
    """Every op's case; ``small`` shrinks them to a smoke test's size."""
    if small:
        return (
            elementwise_cases(device, dtype, 8, 64)
            + attention_cases(device, dtype, 16, 2, 4, 64)
            + moe_cases(device, dtype, 8, 64, 8, 2)
            + paged_cases(device, dtype, 2, 40, 8, 4, 2, 64)
            + cross_entropy_cases(device, dtype, 8, 64, 123)
        )
    return (
        elementwise_cases(device, dtype, 8192, 4096)
        + attention_cases(device, dtype, 2048, 2, 32, 128)
        + moe_cases(device, dtype, 8192, 4096, 64, 8)
        + paged_cases(device, dtype, 64, 2048, 256, 32, 8, 128)
        + cross_entropy_cases(device, dtype, 8192, 4096, 128256)
    )


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors an op returned (one, or a tuple's)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    return [item for item in items if isinstance(item, torch.Tensor)]
