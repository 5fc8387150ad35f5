"""One decode step of the Mamba-2 selective SSM: advance a cached state by a single token."""

from __future__ import annotations

import torch
from mcore_api import experimental_api
from mcore_kernels import mamba_state_update

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
    state in ``state``'s dtype. Computes in float32, or float64 if an input is float64
    (mcore-kernels' ``mamba_state_update`` on a copy of ``state``).
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
    new_state = state.to(dtype, copy=True)  # the kernel's state cache: one slot per sequence
    slots = torch.arange(batch, device=state.device)
    y = mamba_state_update(new_state, slots, x, dt, A, B, C, D)
    return y, new_state.to(state.dtype)
