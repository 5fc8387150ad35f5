"""Rotary embedding on the C++ CPU kernel (``native_build``), with the reference backend's
interface (``rope_reference.rotate``) so that ``rope``'s autograd function runs either."""

from __future__ import annotations

import torch


def rotate(x, cos, sin, interleaved: bool, transpose: bool) -> torch.Tensor:
    """The rotation of rows ``x [R, d]`` by ``cos, sin [C, r]``, or its transpose (the backward),
    as ``rope_reference.rotate``."""
    return torch.ops.mcore_kernels_cpu.rotary(x, cos, sin, bool(interleaved), bool(transpose))
