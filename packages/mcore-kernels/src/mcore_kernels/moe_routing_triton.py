"""MoE top-k routing as Triton kernels: the arithmetic of ``moe_routing_reference`` in float32, each
program a block of tokens by all experts. The top-k is ``k`` rounds of a row maximum (ties go to
the lowest expert id); the chosen experts are kept as a mask over the experts, so probabilities and
gradients are computed over all ``E`` columns at once. The backward recomputes the scores from the
logits.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_routing_reference

# Elements per program (tokens x experts).
_BLOCK_ELEMENTS = 4096
EPSILON = tl.constexpr(moe_routing_reference.EPSILON)


@triton.jit
def _scores(x, valid, SIGMOID: tl.constexpr):
    """``sigmoid(x)`` or the row softmax of ``x``, zero outside ``valid``."""
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        shifted = tl.where(valid, x, float("-inf"))
        e = tl.exp(shifted - tl.max(shifted, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    return tl.where(valid, s, 0.0)


@triton.jit
def _chosen_softmax(x, chosen):
    """The softmax of ``x`` over the ``chosen`` columns of each row, zero elsewhere."""
    shifted = tl.where(chosen, x, float("-inf"))
    e = tl.where(chosen, tl.exp(shifted - tl.max(shifted, axis=1)[:, None]), 0.0)
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _load_block(logits_ptr, n_rows, n_experts, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < n_rows) & (cols[None, :] < n_experts)
    at = rows.to(tl.int64)[:, None] * n_experts + cols[None, :]
    x = tl.load(logits_ptr + at, mask=valid, other=0.0).to(tl.float32)
    return rows, cols, valid, at, x


@triton.jit
def _routing_forward_kernel(
    logits_ptr,
    bias_ptr,
    indices_ptr,
    probs_ptr,
    scores_ptr,
    n_rows,
    n_experts,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    POST_SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CHOOSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows, cols, valid, at, x = _load_block(logits_ptr, n_rows, n_experts, BLOCK_T, BLOCK_E)
    s = _scores(x, valid, SIGMOID)
    in_rows = rows < n_rows
    if POST_SOFTMAX:
        choice = x
    else:
        choice = s
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=cols < n_experts, other=0.0)[None, :]
    chosen = cols[None, :] < 0  # all False
    for j in tl.static_range(K):
        if CHOOSE:
            open_ = valid & (chosen == 0)  # not ~chosen: Triton 3.2's interpreter cannot invert a boolean
            best = tl.max(tl.where(open_, choice, float("-inf")), axis=1)
            hit = open_ & (choice == best[:, None])
            pick = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
            pick = tl.where(pick == BLOCK_E, tl.min(tl.where(open_, cols[None, :], BLOCK_E), axis=1), pick)
            tl.store(indices_ptr + rows.to(tl.int64) * K + j, pick.to(tl.int64), mask=in_rows)
        else:
            pick = tl.load(indices_ptr + rows.to(tl.int64) * K + j, mask=in_rows, other=0).to(tl.int32)
        chosen = chosen | (cols[None, :] == pick[:, None])
    if POST_SOFTMAX:
        p = _chosen_softmax(x, chosen)
    else:
        p = tl.where(chosen, s, 0.0)
        if SIGMOID:
            if K > 1:
                p = p / (tl.sum(p, axis=1)[:, None] + EPSILON)
            s = s / (tl.sum(s, axis=1)[:, None] + EPSILON)
    tl.store(scores_ptr + at, s, mask=valid)
    tl.debug_barrier()  # the chosen ids stored above, read back by the same program
    for j in tl.static_range(K):
        pick = tl.load(indices_ptr + rows.to(tl.int64) * K + j, mask=in_rows, other=0)
        value = tl.sum(tl.where(cols[None, :] == pick[:, None], p, 0.0), axis=1)
        tl.store(probs_ptr + rows.to(tl.int64) * K + j, value, mask=in_rows)


@triton.jit
def _normalize_backward(g, v, valid):
    """Gradient into ``v`` of ``v / (sum(v) + EPSILON)`` per row, given the gradient ``g`` out."""
    total = tl.sum(v, axis=1)[:, None] + EPSILON
    return tl.where(valid, (g - tl.sum(g * v, axis=1)[:, None] / total) / total, 0.0)


@triton.jit
def _routing_backward_kernel(
    logits_ptr,
    indices_ptr,
    dprobs_ptr,
    dscores_ptr,
    dlogits_ptr,
    n_rows,
    n_experts,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    POST_SOFTMAX: tl.constexpr,
    HAS_DSCORES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows, cols, valid, at, x = _load_block(logits_ptr, n_rows, n_experts, BLOCK_T, BLOCK_E)
    s = _scores(x, valid, SIGMOID)
    in_rows = rows < n_rows
    g = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DSCORES:
        g = tl.load(dscores_ptr + at, mask=valid, other=0.0).to(tl.float32)
    gp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)  # dprobs scattered to the chosen columns
    chosen = cols[None, :] < 0
    for j in tl.static_range(K):
        pick = tl.load(indices_ptr + rows.to(tl.int64) * K + j, mask=in_rows, other=0)
        hit = cols[None, :] == pick[:, None]
        dp = tl.load(dprobs_ptr + rows.to(tl.int64) * K + j, mask=in_rows, other=0.0).to(tl.float32)
        gp = tl.where(hit, dp[:, None], gp)
        chosen = chosen | hit
    if SIGMOID:
        ds = _normalize_backward(g, s, valid)
        if K > 1:
            ds += _normalize_backward(gp, tl.where(chosen, s, 0.0), chosen)
        else:
            ds += gp
        dx = ds * s * (1.0 - s)
    elif POST_SOFTMAX:
        p = _chosen_softmax(x, chosen)
        dx = s * (g - tl.sum(s * g, axis=1)[:, None]) + p * (gp - tl.sum(p * gp, axis=1)[:, None])
    else:
        total = g + gp
        dx = s * (total - tl.sum(s * total, axis=1)[:, None])
    tl.store(dlogits_ptr + at, dx, mask=valid)


def _blocks(n_experts: int) -> tuple[int, int]:
    block_e = triton.next_power_of_2(n_experts)
    return max(1, min(64, _BLOCK_ELEMENTS // block_e)), block_e


def routing_forward(
    logits: torch.Tensor,
    topk: int,
    sigmoid: bool,
    post_softmax: bool,
    expert_bias: torch.Tensor | None,
    indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [T, k], indices [T, k], scores [T, E])`` (float32, int64, float32) for contiguous
    ``logits [T, E]``; ``indices`` (contiguous int64) skip the choice."""
    tokens, experts = logits.shape
    block_t, block_e = _blocks(experts)
    choose = indices is None
    if choose:
        indices = torch.empty(tokens, topk, device=logits.device, dtype=torch.int64)
    probs = torch.empty(tokens, topk, device=logits.device, dtype=torch.float32)
    scores = torch.empty(tokens, experts, device=logits.device, dtype=torch.float32)
    _routing_forward_kernel[(triton.cdiv(tokens, block_t),)](
        logits,
        expert_bias if expert_bias is not None else logits,
        indices,
        probs,
        scores,
        tokens,
        experts,
        K=topk,
        SIGMOID=sigmoid,
        POST_SOFTMAX=post_softmax,
        HAS_BIAS=expert_bias is not None,
        CHOOSE=choose,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return probs, indices, scores


def routing_backward(
    logits: torch.Tensor,
    indices: torch.Tensor,
    dprobs: torch.Tensor,
    dscores: torch.Tensor | None,
    sigmoid: bool,
    post_softmax: bool,
) -> torch.Tensor:
    """The logits' gradient (float32 ``[T, E]``) from the probabilities' and the scores' (``None``:
    zero), all contiguous."""
    tokens, experts = logits.shape
    block_t, block_e = _blocks(experts)
    dlogits = torch.empty(tokens, experts, device=logits.device, dtype=torch.float32)
    _routing_backward_kernel[(triton.cdiv(tokens, block_t),)](
        logits,
        indices,
        dprobs,
        dscores if dscores is not None else dprobs,
        dlogits,
        tokens,
        experts,
        K=indices.shape[1],
        SIGMOID=sigmoid,
        POST_SOFTMAX=post_softmax,
        HAS_DSCORES=dscores is not None,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return dlogits
