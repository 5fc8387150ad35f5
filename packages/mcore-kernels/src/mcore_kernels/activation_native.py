"""SwiGLU on the C++ CPU kernels (``native_build``), with the reference backend's interface
(``activation_reference``) so that ``activations``' autograd function runs either. Only the plain
SwiGLU (``[gate, up]`` halves, no clamp, offset nor per-token weights) has a native kernel, and
``activations`` dispatches only that one here (``spec`` is ``PLAIN_SWIGLU``, ``probs`` ``None``)."""

from __future__ import annotations

import torch

from .activation_reference import ActivationSpec

PLAIN_SWIGLU = ActivationSpec("silu", True)


def activation_forward(x: torch.Tensor, probs, spec: ActivationSpec) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``x [M, 2K]``, as ``activation_reference.activation_forward``."""
    return torch.ops.mcore_kernels_cpu.swiglu(x)


def activation_backward(dout: torch.Tensor, x: torch.Tensor, probs, spec: ActivationSpec):
    """``(dx, None)``, as ``activation_reference.activation_backward``."""
    return torch.ops.mcore_kernels_cpu.swiglu_backward(dout, x), None
