"""Mamba-2's gated RMSNorm: an RMSNorm over groups of channels combined with a SiLU gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mcore_api import experimental_api

from ._shapes import compute_dtype


@experimental_api
def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Normalise ``x`` ``[..., channels]`` and gate it by ``silu(z)`` (same shape as ``x``).

    The root-mean-square is taken separately over each run of ``group_size`` consecutive channels
    (``group_size == channels``: one group), then the result is scaled by ``weight`` ``[channels]``.
    ``norm_before_gate=False`` (Mamba-2's default): ``rmsnorm(x * silu(z)) * weight``;
    ``True``: ``rmsnorm(x) * weight * silu(z)``. Computes in float32 (or wider); returns ``x``'s dtype.
    """
    channels = x.shape[-1] if x.dim() > 0 else 0
    if x.dim() == 0 or tuple(z.shape) != tuple(x.shape):
        raise ValueError(
            f"z must have the shape of x, and x at least one dimension [..., channels]; "
            f"got x {list(x.shape)} and z {list(z.shape)}"
        )
    if tuple(weight.shape) != (channels,):
        raise ValueError(
            f"weight must have shape [channels] = [{channels}] to match x of shape {list(x.shape)}; "
            f"got {list(weight.shape)}"
        )
    if group_size < 1 or channels % group_size != 0:
        raise ValueError(
            f"group_size ({group_size}) must be >= 1 and divide the number of channels ({channels})"
        )
    dtype = compute_dtype(x, z, weight)
    values = x.to(dtype)
    gate = F.silu(z.to(dtype))
    if not norm_before_gate:
        values = values * gate
    grouped = values.unflatten(-1, (channels // group_size, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = normed.flatten(-2) * weight.to(dtype)
    if norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
