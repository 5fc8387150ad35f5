"""Attention softmax as Triton kernels: the arithmetic of ``softmax_reference`` (float32, one rounding
of the output), one program per row of scores, taken in blocks of at most ``MAX_BLOCK`` columns with
a running maximum, the causal band and window computed from the row's position instead of read from
a mask. The backward keeps only the probabilities and each row's sink
probability: ``ds = scale * p * (dp - sum(p dp))``, ``dsink = -sum over rows of p_sink * sum(p dp)``.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program holds at once; longer rows are read in blocks of this many (twice forward, for
# the maximum and sum and then the probabilities; twice backward).
MAX_BLOCK = 4096


@triton.jit
def _allowed_scores(
    x_ptr,
    allowed_ptr,
    row,
    cols,
    n_q,
    n_k,
    scale,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """The scaled scores of columns ``cols`` of ``row`` (-inf where not allowed) and the allowed mask."""
    keep = cols < n_k
    offsets = row * n_k + cols
    x = tl.load(x_ptr + offsets, mask=keep, other=0.0).to(tl.float32) * scale
    if CAUSAL:
        distance = (row % n_q + (n_k - n_q)) - cols
        keep = keep & (distance >= 0)
        if HAS_WINDOW:
            keep = keep & (distance < window)
    if HAS_MASK:
        keep = keep & (tl.load(allowed_ptr + offsets, mask=keep, other=0) != 0)
    return tl.where(keep, x, float("-inf")), keep


@triton.jit
def _softmax_forward_kernel(
    x_ptr,
    allowed_ptr,
    sink_ptr,
    p_ptr,
    p_sink_ptr,
    n_q,
    n_k,
    n_heads,
    scale,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # first pass: the row's maximum and the sum of exponentials, rescaled block by block
    m = tl.full([], float("-inf"), tl.float32)
    if HAS_SINK:
        sink = tl.load(sink_ptr + (row // n_q) % n_heads).to(tl.float32)
        m = sink
    z = tl.full([], 0.0, tl.float32)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        s, keep = _allowed_scores(
            x_ptr, allowed_ptr, row, cols, n_q, n_k, scale, window, CAUSAL, HAS_WINDOW, HAS_MASK
        )
        m_new = tl.maximum(m, tl.max(s, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: all terms zero
        z = z * tl.exp(m - shift) + tl.sum(tl.where(keep, tl.exp(s - shift), 0.0), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    if HAS_SINK:
        e_sink = tl.exp(sink - m)
        z = z + e_sink
    inverse = 1.0 / tl.where(z > 0.0, z, 1.0)  # an empty row's terms are all zero
    # second pass: the probabilities
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        s, keep = _allowed_scores(
            x_ptr, allowed_ptr, row, cols, n_q, n_k, scale, window, CAUSAL, HAS_WINDOW, HAS_MASK
        )
        p = tl.where(keep, tl.exp(s - m), 0.0) * inverse
        tl.store(p_ptr + row * n_k + cols, p.to(p_ptr.dtype.element_ty), mask=cols < n_k)
    if HAS_SINK:
        tl.store(p_sink_ptr + row, e_sink * inverse)


@triton.jit
def _softmax_backward_kernel(
    p_ptr,
    dp_ptr,
    p_sink_ptr,
    ds_ptr,
    dsink_rows_ptr,
    n_k,
    scale,
    HAS_SINK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dot = tl.full([], 0.0, tl.float32)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_k
        p = tl.load(p_ptr + row * n_k + cols, mask=inside, other=0.0).to(tl.float32)
        dp = tl.load(dp_ptr + row * n_k + cols, mask=inside, other=0.0).to(tl.float32)
        dot += tl.sum(p * dp, axis=0)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_k
        offsets = row * n_k + cols
        p = tl.load(p_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        dp = tl.load(dp_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(ds_ptr + offsets, (p * (dp - dot) * scale).to(ds_ptr.dtype.element_ty), mask=inside)
    if HAS_SINK:
        tl.store(dsink_rows_ptr + row, -tl.load(p_sink_ptr + row) * dot)


def _block(n_k: int) -> int:
    """Columns a loop step reads; the kernels loop over ``BLOCKS = cdiv(n_k, BLOCK)`` steps, a
    compile-time count (Triton 3.2's interpreter cannot loop to a run-time bound with numpy 2.4)."""
    return min(triton.next_power_of_2(n_k), MAX_BLOCK)


def softmax_forward(
    scores: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: int | None,
    sink_logits: torch.Tensor | None,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(probs, p_sink)`` for contiguous ``scores [..., n, q, k]`` and ``allowed`` (``None`` or int8 of
    the scores' shape); ``p_sink [rows]`` float32 is each row's sink probability (``None`` without)."""
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    rows = scores.numel() // n_k
    probs = torch.empty_like(scores)
    p_sink = torch.empty(rows, device=scores.device, dtype=torch.float32) if sink_logits is not None else None
    _softmax_forward_kernel[(rows,)](
        scores,
        allowed if allowed is not None else scores,
        sink_logits if sink_logits is not None else scores,
        probs,
        p_sink if p_sink is not None else probs,
        n_q,
        n_k,
        scores.shape[-3] if scores.dim() >= 3 else 1,
        scale,
        window_size or 0,
        CAUSAL=causal,
        HAS_WINDOW=window_size is not None,
        HAS_MASK=allowed is not None,
        HAS_SINK=sink_logits is not None,
        BLOCK=_block(n_k),
        BLOCKS=triton.cdiv(n_k, _block(n_k)),
    )
    return probs, p_sink


def softmax_backward(
    dprobs: torch.Tensor, probs: torch.Tensor, p_sink: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dscores, dsink_rows)``: the scores' gradient and, with a sink, each row's share of the
    sink's gradient (float32 ``[rows]``, summed per head by the caller)."""
    n_k = probs.shape[-1]
    rows = probs.numel() // n_k
    dscores = torch.empty_like(probs)
    dsink_rows = torch.empty(rows, device=probs.device, dtype=torch.float32) if p_sink is not None else None
    _softmax_backward_kernel[(rows,)](
        probs,
        dprobs,
        p_sink if p_sink is not None else probs,
        dscores,
        dsink_rows if dsink_rows is not None else probs,
        n_k,
        scale,
        HAS_SINK=p_sink is not None,
        BLOCK=_block(n_k),
        BLOCKS=triton.cdiv(n_k, _block(n_k)),
    )
    return dscores, dsink_rows
