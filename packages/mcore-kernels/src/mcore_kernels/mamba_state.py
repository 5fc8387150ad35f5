"""``mamba_state_update``: one decode token of Mamba-2's selective state space for a batch of
requests, each advancing its own slot of a state cache in place (a C++ CPU kernel,
``native_build``; the PyTorch reference elsewhere)."""

from __future__ import annotations

import torch

from .dispatch import autograd_records, select_elementwise_backend
from .mamba_state_reference import mamba_state_update_reference

_OP = "mamba_state_update"


def mamba_state_update(
    states: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advance the states ``states[slots]`` by one token each, in place, and read them out.

    Shapes: ``states [S, h, p, n]`` (the cache: ``S`` slots of ``h`` heads' ``[p, n]`` states);
    ``slots [b]`` int64, distinct; ``x [b, h, p]``; ``dt [b, h]`` (positive: softplus'ed and
    clamped already); ``A [h]`` (negative); ``B``, ``C [b, g, n]`` (``g`` groups dividing ``h``);
    ``D [h]`` optional skip. For row ``r``, head ``k`` of group ``q = k // (h / g)``:
    ``s = exp(dt[r, k] A[k]) s + dt[r, k] x[r, k] ⊗ B[r, q]`` with ``s = states[slots[r], k]``,
    and ``y[r, k] = s C[r, q] + D[k] x[r, k]``.

    Returns ``y [b, h, p]`` in ``x``'s dtype. Computes in float32 (float64 if an input is float64);
    the states keep their dtype. The native kernel runs float32 states on the CPU without autograd.

    Raises:
        TypeError: a tensor that is not floating point (``slots``: not int64).
        ValueError: shapes that do not match, or a slot out of range or named twice.
    """
    b, h, p = _check(states, slots, x, dt, A, B, C, D)
    if not b:
        return x.new_empty(0, h, p)
    native = (
        select_elementwise_backend(_OP, x, kernels=("native",)) == "native"
        and states.dtype == torch.float32
        and not autograd_records(states, x, dt, A, B, C, D)
    )
    if native:
        floats = [t.float().contiguous() for t in (x, dt, A, B, C)]
        D_float = None if D is None else D.float().contiguous()
        y = torch.ops.mcore_kernels_cpu.mamba_state_update(states, slots.contiguous(), *floats, D_float)
    else:
        _check_slot_values(slots, states.shape[0])
        y = mamba_state_update_reference(states, slots, x, dt, A, B, C, D)
    return y.to(x.dtype)


def _check(states, slots, x, dt, A, B, C, D) -> tuple[int, int, int]:
    """``(b, h, p)`` of valid arguments."""
    tensors = {"states": states, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D}
    for name, tensor in tensors.items():
        if tensor is not None and not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
            raise TypeError(f"{_OP}: {name} must be a floating-point tensor")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        raise TypeError(f"{_OP}: slots must be an int64 [b] tensor")
    if states.dim() != 4 or B.dim() != 3:
        raise ValueError(f"{_OP}: states must be [S, h, p, n] and B [b, g, n]")
    _, h, p, n = states.shape
    b, g = slots.shape[0], B.shape[1]
    if g == 0 or h % g:
        raise ValueError(f"{_OP}: B's {g} groups must divide the {h} heads")
    expected = {"x": (b, h, p), "dt": (b, h), "A": (h,), "B": (b, g, n), "C": (b, g, n), "D": (h,)}
    for name, shape in expected.items():
        tensor = tensors[name]
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{_OP}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return b, h, p


def _check_slot_values(slots: torch.Tensor, num_slots: int) -> None:
    if ((slots < 0) | (slots >= num_slots)).any():
        raise ValueError(f"{_OP}: a slot is not one of the {num_slots} state slots: {slots.tolist()}")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"{_OP}: a slot is named twice: {slots.tolist()}")
