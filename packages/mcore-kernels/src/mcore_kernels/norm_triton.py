"""RMSNorm and LayerNorm as Triton kernels: the same arithmetic as ``norm_reference`` (float32
statistics, one rounding of the output), one program per row forward; each backward program takes a
run of rows and keeps its share of the weight and bias gradients in registers.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs of the backward pass (at most): each takes a run of rows and sums the weight gradient
# over them; the partial sums (programs x N, float32) are added up by torch.
_BACKWARD_PROGRAMS = 64


@triton.jit
def _norm_forward_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    y_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    eps,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=inside, other=0.0)
        h = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded as x + residual
        tl.store(h_ptr + offsets, h, mask=inside)
    else:
        h = x
    hf = h.to(tl.float32)
    if IS_RMS:
        mean = tl.sum(hf, axis=0) * 0.0
        centered = hf
    else:
        mean = tl.sum(hf, axis=0) / n_cols
        centered = tl.where(inside, hf - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    gamma = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    y = centered * rstd * gamma
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(x.dtype), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_backward_kernel(
    dy_ptr,
    dh_out_ptr,
    h_ptr,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    dh_ptr,
    dweight_partial_ptr,
    dbias_partial_ptr,
    n_rows,
    n_cols,
    IS_RMS: tl.constexpr,
    HAS_DH_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    gamma = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    dweight = tl.zeros([BLOCK], dtype=tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM):
        row = program * ROWS_PER_PROGRAM + i
        present = inside & ((cols * 0 + row) < n_rows)  # the last program may run past the rows
        offsets = row * n_cols + cols
        dy = tl.load(dy_ptr + offsets, mask=present, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offsets, mask=present, other=0.0)
        mean = tl.load(mean_ptr + tl.minimum(row, n_rows - 1))
        rstd = tl.load(rstd_ptr + tl.minimum(row, n_rows - 1))
        normed = tl.where(present, (h.to(tl.float32) - mean) * rstd, 0.0)
        dnormed = dy * gamma
        projection = tl.sum(dnormed * normed, axis=0) / n_cols
        if IS_RMS:
            dh = rstd * (dnormed - normed * projection)
        else:
            dh = rstd * (dnormed - tl.sum(dnormed, axis=0) / n_cols - normed * projection)
        if HAS_DH_OUT:
            dh = dh + tl.load(dh_out_ptr + offsets, mask=present, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offsets, dh.to(h.dtype), mask=present)
        dweight += dy * normed
        if HAS_BIAS:
            dbias += dy
    tl.store(dweight_partial_ptr + program * n_cols + cols, dweight, mask=inside)
    if HAS_BIAS:
        tl.store(dbias_partial_ptr + program * n_cols + cols, dbias, mask=inside)


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``norm_reference.norm_forward``, for contiguous ``x [M, N]`` (and ``residual``)."""
    rows, cols = x.shape
    y = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    _norm_forward_kernel[(rows,)](
        x,
        x if residual is None else residual,
        weight,
        weight if bias is None else bias,
        y,
        h,
        mean,
        rstd,
        cols,
        eps,
        IS_RMS=rms,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK=triton.next_power_of_2(cols),
    )
    return y, h, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
    rms: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As ``norm_reference.norm_backward``, for contiguous ``dy`` and ``h`` ``[M, N]``."""
    rows, cols = h.shape
    # A power of two (a compile-time constant: few kernel variants, and a loop bound Triton's
    # interpreter accepts in every version).
    rows_per_program = triton.next_power_of_2(triton.cdiv(rows, _BACKWARD_PROGRAMS))
    programs = triton.cdiv(rows, rows_per_program)
    dh = torch.empty_like(h)
    dweight = torch.empty(programs, cols, dtype=torch.float32, device=h.device)
    dbias = torch.empty_like(dweight) if has_bias else dweight
    _norm_backward_kernel[(programs,)](
        dy,
        dy if dh_out is None else dh_out,
        h,
        weight,
        mean,
        rstd,
        dh,
        dweight,
        dbias,
        rows,
        cols,
        IS_RMS=rms,
        HAS_DH_OUT=dh_out is not None,
        HAS_BIAS=has_bias,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK=triton.next_power_of_2(cols),
        ROWS_PER_PROGRAM=rows_per_program,
    )
    return dh, dweight.sum(0).to(weight.dtype), dbias.sum(0).to(weight.dtype) if has_bias else None
