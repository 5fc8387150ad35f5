"""MLP activations as Triton kernels: the same arithmetic as ``activation_reference`` (float32, one
rounding of each output), each program a block of rows by a block of output columns. The backward
recomputes the activation from ``x``; the probabilities' gradient is summed per block here and over
the blocks by torch.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation_reference import KINDS, ActivationSpec

# Elements per program (rows x columns), and the widest column block.
_BLOCK_ELEMENTS = 4096
_MAX_BLOCK_COLUMNS = 1024


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _value_and_slope(x, KIND: tl.constexpr, ALPHA: tl.constexpr):
    """``act(x)`` and ``act'(x)`` in float32; ``KIND`` indexes ``KINDS``."""
    if KIND == 0:  # silu
        s = _sigmoid(x)
        value = x * s
        slope = s * (1.0 + x * (1.0 - s))
    elif KIND == 1:  # gelu (erf)
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        value = x * cdf
        slope = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif KIND == 2:  # quick_gelu
        s = _sigmoid(x * ALPHA)
        value = x * s
        slope = s + ALPHA * x * s * (1.0 - s)
    else:  # squared_relu
        positive = tl.maximum(x, 0.0)
        value = positive * positive
        slope = 2.0 * positive
    return value, slope


@triton.jit
def _offsets(rows, cols, n_cols, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Offsets of the gate (or plain input) and of the linear half in ``x``, and of the output."""
    if GATED:
        base = rows.to(tl.int64)[:, None] * (2 * n_cols)
        if INTERLEAVED:
            gate = base + 2 * cols[None, :]
            up = gate + 1
        else:
            gate = base + cols[None, :]
            up = gate + n_cols
    else:
        gate = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        up = gate
    out = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    return gate, up, out


@triton.jit
def _clamped(gate, up, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr):
    if HAS_CLAMP:
        gate = tl.minimum(gate, CLAMP)
        up = tl.minimum(tl.maximum(up, -CLAMP), CLAMP)
    return gate, up


@triton.jit
def _activation_forward_kernel(
    x_ptr,
    probs_ptr,
    out_ptr,
    n_rows,
    n_cols,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    ALPHA: tl.constexpr,
    OFFSET: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    gate_at, up_at, out_at = _offsets(rows, cols, n_cols, GATED, INTERLEAVED)
    x = tl.load(x_ptr + gate_at, mask=inside, other=0.0)
    if GATED:
        up = tl.load(x_ptr + up_at, mask=inside, other=0.0).to(tl.float32)
        gate, up = _clamped(x.to(tl.float32), up, HAS_CLAMP, CLAMP)
        value, _ = _value_and_slope(gate, KIND, ALPHA)
        out = value * (up + OFFSET)
    else:
        out, _ = _value_and_slope(x.to(tl.float32), KIND, ALPHA)
    if HAS_PROBS:
        probs = tl.load(probs_ptr + rows, mask=rows < n_rows, other=0.0).to(tl.float32)
        out = out * probs[:, None]
    tl.store(out_ptr + out_at, out.to(x.dtype), mask=inside)


@triton.jit
def _activation_backward_kernel(
    dout_ptr,
    x_ptr,
    probs_ptr,
    dx_ptr,
    dprobs_partial_ptr,
    n_rows,
    n_cols,
    KIND: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    ALPHA: tl.constexpr,
    OFFSET: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    gate_at, up_at, out_at = _offsets(rows, cols, n_cols, GATED, INTERLEAVED)
    x = tl.load(x_ptr + gate_at, mask=inside, other=0.0)
    dout = tl.load(dout_ptr + out_at, mask=inside, other=0.0).to(tl.float32)
    weighted = dout
    if HAS_PROBS:
        probs = tl.load(probs_ptr + rows, mask=rows < n_rows, other=0.0).to(tl.float32)
        weighted = dout * probs[:, None]
    if GATED:
        gate_in = x.to(tl.float32)
        up_in = tl.load(x_ptr + up_at, mask=inside, other=0.0).to(tl.float32)
        gate, up = _clamped(gate_in, up_in, HAS_CLAMP, CLAMP)
        value, slope = _value_and_slope(gate, KIND, ALPHA)
        linear = up + OFFSET
        dgate = weighted * linear * slope
        dup = weighted * value
        if HAS_CLAMP:
            dgate = tl.where(gate_in <= CLAMP, dgate, 0.0)
            dup = tl.where((up_in >= -CLAMP) & (up_in <= CLAMP), dup, 0.0)
        tl.store(dx_ptr + gate_at, dgate.to(x.dtype), mask=inside)
        tl.store(dx_ptr + up_at, dup.to(x.dtype), mask=inside)
        contribution = dout * value * linear
    else:
        value, slope = _value_and_slope(x.to(tl.float32), KIND, ALPHA)
        tl.store(dx_ptr + gate_at, (weighted * slope).to(x.dtype), mask=inside)
        contribution = dout * value
    if HAS_PROBS:
        partial = tl.sum(tl.where(inside, contribution, 0.0), axis=1)
        tl.store(dprobs_partial_ptr + tl.program_id(1) * n_rows + rows, partial, mask=rows < n_rows)


def _launch(spec: ActivationSpec, rows: int, cols: int):
    """The grid, and the compile-time arguments, for ``rows x cols`` outputs."""
    block_n = min(triton.next_power_of_2(cols), _MAX_BLOCK_COLUMNS)
    block_m = min(triton.next_power_of_2(rows), max(1, _BLOCK_ELEMENTS // block_n))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    constants = dict(
        KIND=KINDS.index(spec.kind),
        GATED=spec.gated,
        INTERLEAVED=spec.interleaved,
        HAS_CLAMP=spec.clamp is not None,
        ALPHA=float(spec.alpha),
        OFFSET=float(spec.offset),
        CLAMP=0.0 if spec.clamp is None else float(spec.clamp),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return grid, constants


def activation_forward(x: torch.Tensor, probs: torch.Tensor | None, spec: ActivationSpec) -> torch.Tensor:
    """As ``activation_reference.activation_forward``, for contiguous ``x [M, K]`` and ``probs``."""
    rows = x.shape[0]
    cols = x.shape[1] // 2 if spec.gated else x.shape[1]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid, constants = _launch(spec, rows, cols)
    _activation_forward_kernel[grid](
        x, x if probs is None else probs, out, rows, cols, HAS_PROBS=probs is not None, **constants
    )
    return out


def activation_backward(
    dout: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None, spec: ActivationSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As ``activation_reference.activation_backward``, for contiguous ``dout``, ``x`` and ``probs``."""
    rows, cols = dout.shape
    dx = torch.empty_like(x)
    if dout.numel() == 0:
        return dx.zero_(), None if probs is None else torch.zeros_like(probs)
    grid, constants = _launch(spec, rows, cols)
    partial = None
    if probs is not None:
        partial = torch.empty(grid[1], rows, dtype=torch.float32, device=x.device)
    _activation_backward_kernel[grid](
        dout,
        x,
        x if probs is None else probs,
        dx,
        dx if partial is None else partial,
        rows,
        cols,
        HAS_PROBS=probs is not None,
        **constants,
    )
    return dx, None if partial is None else partial.sum(0).to(probs.dtype)
