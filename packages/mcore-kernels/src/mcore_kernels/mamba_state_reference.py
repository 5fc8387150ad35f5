"""The PyTorch reference of ``mamba_state_update``: gather the slots, advance, scatter back."""

from __future__ import annotations

import torch


def mamba_state_update_reference(
    states: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    """``mamba_state_update`` in float32 (float64 if an input is float64), by the formula."""
    dtype = (
        torch.float64
        if torch.float64 in {t.dtype for t in (states, x, dt, A, B, C, D) if t is not None}
        else torch.float32
    )
    per_group = states.shape[1] // B.shape[1]
    B_heads, C_heads = (t.to(dtype).repeat_interleave(per_group, dim=1) for t in (B, C))  # [b, h, n]
    x, dt = x.to(dtype), dt.to(dtype)
    decay = torch.exp(dt * A.to(dtype))[..., None, None]
    new = decay * states[slots].to(dtype) + (dt[..., None] * x)[..., None] * B_heads[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, C_heads)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    states[slots] = new.to(states.dtype)
    return y
