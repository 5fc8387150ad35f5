"""One decode step of the Mamba-2 selective SSM: advance a cached state by a single token."""

from __future__ import annotations

import torch
from mcore_api import experimental_api

from ._shapes import check_groups, compute_dtype, require_rank, require_shape


@experimental_api
def ssd_decode_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance ``state`` by one token and read it out; ``state`` itself is left unchanged.

    Shapes: ``state`` ``[batch, nheads, headdim, dstate]``; ``x`` ``[batch, nheads, headdim]``;
    ``dt`` ``[batch, nheads]`` (positive, already softplus'ed); ``A`` ``[nheads]`` (negative);
    ``B``, ``C`` ``[batch, ngroups, dstate]``; ``D`` ``[nheads]`` optional skip.

    Returns ``(y, new_state)``: ``y`` ``[batch, nheads, headdim]`` in ``x``'s dtype and the new
    state in ``state``'s dtype. Computes in float32, or float64 if an input is float64.
    """
    require_rank("state", state, "[batch, nheads, headdim, dstate]")
    batch, nheads, headdim, dstate = state.shape
    context = f"to match state of shape {list(state.shape)}"
    require_shape("x", x, (batch, nheads, headdim), "[batch, nheads, headdim]", context)
    require_shape("dt", dt, (batch, nheads), "[batch, nheads]", context)
    require_shape("A", A, (nheads,), "[nheads]", context)
    require_rank("B", B, "[batch, ngroups, dstate]")
    ngroups = B.shape[1]
    require_shape("B", B, (batch, ngroups, dstate), "[batch, ngroups, dstate]", context)
    require_shape("C", C, (batch, ngroups, dstate), "[batch, ngroups, dstate]", "to match B")
    check_groups(nheads, ngroups, B.shape)
    if D is not None:
        require_shape("D", D, (nheads,), "[nheads]", context)

    dtype = compute_dtype(state, x, dt, A, B, C, D)
    heads_per_group = nheads // ngroups
    B_per_head = B.to(dtype).repeat_interleave(heads_per_group, dim=1)  # [batch, nheads, dstate]
    C_per_head = C.to(dtype).repeat_interleave(heads_per_group, dim=1)
    x_f, dt_f = x.to(dtype), dt.to(dtype)
    decay = torch.exp(dt_f * A.to(dtype))[..., None, None]
    new_state = decay * state.to(dtype) + (dt_f[..., None] * x_f)[..., None] * B_per_head[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, C_per_head)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x_f
    return y.to(x.dtype), new_state.to(state.dtype)
