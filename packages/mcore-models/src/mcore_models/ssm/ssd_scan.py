"""The chunked state-space-duality (SSD) scan of Mamba-2.

The selective SSM recurrence

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t,        y_t = h_t · C_t + D * x_t

is evaluated chunk by chunk: inside a chunk as a masked quadratic ("attention-like") form whose
mask holds the decays between every pair of positions, and across chunks by carrying one state per
chunk boundary. Cost is linear in the sequence length and quadratic only in ``chunk_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mcore_api import experimental_api

from ._shapes import SSDDims, check_sequence_inputs, compute_dtype
from .cuda_kernels import chunk_scan_kernel


def segment_sum(log_decay: torch.Tensor) -> torch.Tensor:
    """``[..., T] -> [..., T, T]``: entry ``[i, j]`` is ``sum(log_decay[j+1 : i+1])`` for ``i >= j``
    and ``-inf`` above the diagonal, so that ``exp`` of it is the causal decay matrix.

    Every entry is a sum of the log-decays strictly between ``j`` and ``i`` (built by a masked
    cumulative sum, not as a difference of two long prefix sums), so for non-positive inputs the
    result is non-positive and exact up to the rounding of that short sum.
    """
    length = log_decay.shape[-1]
    rows = log_decay.unsqueeze(-1).expand(*log_decay.shape, length)  # [..., i, j] = log_decay[i]
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = rows.masked_fill(~strictly_below, 0.0).cumsum(dim=-2)
    on_or_below = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril(0)
    return sums.masked_fill(~on_or_below, float("-inf"))


@experimental_api
def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the selective SSM over a whole sequence with the chunked SSD algorithm.

    Shapes: ``x`` ``[batch, seqlen, nheads, headdim]``; ``dt`` ``[batch, seqlen, nheads]`` (positive,
    already softplus'ed and clamped); ``A`` ``[nheads]`` (negative); ``B``, ``C``
    ``[batch, seqlen, ngroups, dstate]``, head ``h`` reading group ``h // (nheads // ngroups)``;
    ``D`` ``[nheads]`` optional skip; ``initial_state`` ``[batch, nheads, headdim, dstate]`` optional.

    Any ``seqlen`` works: the last chunk is padded with ``dt = 0`` steps, which neither decay nor
    feed the state. Computes in float32 (float64 if an input is float64) and is differentiable.

    Returns ``y`` ``[batch, seqlen, nheads, headdim]`` in ``x``'s dtype, and with
    ``return_final_state`` also the state after the last token, ``[batch, nheads, headdim, dstate]``
    in the compute dtype. On CUDA with ``mamba_ssm`` installed its Triton kernel computes it
    (``cuda_kernels``).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    dims = check_sequence_inputs(x, dt, A, B, C, D, initial_state)
    dtype = compute_dtype(x, dt, A, B, C, D, initial_state)
    kernel = chunk_scan_kernel(x, dt, A, B, C, D, initial_state)
    if kernel is not None:
        return _run_kernel(kernel, x, dt, A, B, C, chunk_size, D, initial_state, return_final_state, dtype)
    seqlen = x.shape[1]
    pad = (-seqlen) % chunk_size
    nchunks = (seqlen + pad) // chunk_size

    def chunked(t: torch.Tensor, trailing: int) -> torch.Tensor:
        """Pad the sequence dim (1) with zeros and split it into ``[nchunks, chunk_size]``."""
        t = F.pad(t.to(dtype), (0, 0) * trailing + (0, pad))
        return t.reshape(t.shape[0], nchunks, chunk_size, *t.shape[2:])

    groups, per_group = dims.ngroups, dims.heads_per_group
    # Heads are split as [ngroups, heads_per_group] so that B and C are never copied per head.
    x_c = chunked(x, 2).unflatten(3, (groups, per_group))  # [b, c, l, g, r, p]
    dt_c = chunked(dt, 1).unflatten(3, (groups, per_group))  # [b, c, l, g, r]
    B_c = chunked(B, 2)  # [b, c, l, g, n]
    C_c = chunked(C, 2)  # [b, c, l, g, n]
    x_dt = x_c * dt_c.unsqueeze(-1)
    log_decay = (dt_c * A.to(dtype).view(groups, per_group)).permute(0, 3, 4, 1, 2)  # [b, g, r, c, l]
    log_decay_cum = log_decay.cumsum(dim=-1)

    # 1. Within each chunk: y_l += sum_{s<=l} (C_l · B_s) * decay(s -> l) * dt_s x_s.
    decay_within = torch.exp(segment_sum(log_decay))  # [b, g, r, c, l, s]
    scores = torch.einsum("bclgn,bcsgn->bcgls", C_c, B_c)
    y = torch.einsum("bcgls,bgrcls,bcsgrp->bclgrp", scores, decay_within, x_dt)

    # 2. The state each chunk adds by its end, starting from zero.
    decay_to_chunk_end = torch.exp(log_decay_cum[..., -1:] - log_decay_cum)  # [b, g, r, c, l]
    chunk_states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", B_c, decay_to_chunk_end, x_dt)

    # 3. Carry the state across chunk boundaries: entering[c] is the state before chunk c.
    chunk_decay = torch.exp(log_decay_cum[..., -1])  # [b, g, r, c]
    state = _initial_grouped_state(initial_state, dims, dtype, x.device)
    entering = []
    for chunk in range(nchunks):
        entering.append(state)
        state = chunk_decay[..., chunk, None, None] * state + chunk_states[:, chunk]
    entering_states = torch.stack(entering, dim=1)  # [b, c, g, r, p, n]

    # 4. What the entering state contributes to every position of its chunk.
    decay_from_chunk_start = torch.exp(log_decay_cum)  # [b, g, r, c, l]
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C_c, entering_states, decay_from_chunk_start)

    y = y.reshape(dims.batch, nchunks * chunk_size, dims.nheads, dims.headdim)[:, :seqlen]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    y = y.to(x.dtype)
    if return_final_state:
        return y, state.reshape(dims.batch, dims.nheads, dims.headdim, dims.dstate)
    return y


def _initial_grouped_state(
    initial_state: torch.Tensor | None, dims: SSDDims, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The state before the first token as ``[batch, ngroups, heads_per_group, headdim, dstate]``."""
    shape = (dims.batch, dims.ngroups, dims.heads_per_group, dims.headdim, dims.dstate)
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return initial_state.to(dtype).reshape(shape)


def _run_kernel(kernel, x, dt, A, B, C, chunk_size, D, initial_state, return_final_state, dtype):
    """``ssd_chunked_scan`` through ``mamba_ssm``'s kernel, results in ``ssd_chunked_scan``'s dtypes."""
    contiguous = [t if t is None else t.contiguous() for t in (x, dt, A, B, C, D, initial_state)]
    x, dt, A, B, C, D, initial_state = contiguous
    result = kernel(
        x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=return_final_state
    )
    if return_final_state:
        y, final_state = result
        return y.to(x.dtype), final_state.to(dtype)
    return result.to(x.dtype)
