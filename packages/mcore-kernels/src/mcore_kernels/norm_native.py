"""RMSNorm on the C++ CPU kernels (``native_build``), with the reference backend's interface
(``norm_reference``) so that ``norm``'s autograd function runs either. Only RMSNorm (``rms``, no
bias) has a native kernel: ``layer_norm`` never dispatches here, so ``bias`` is always ``None``
and ``rms`` true."""

from __future__ import annotations

import torch


def norm_forward(x, weight, bias, residual, eps, zero_centered_gamma, rms):
    """``(y, h, mean, rstd)`` for rows ``x [M, N]`` as ``norm_reference.norm_forward`` (``mean``
    is ``None``: RMSNorm has none)."""
    y, h, rstd = torch.ops.mcore_kernels_cpu.rms_norm(
        x, weight, residual, float(eps), bool(zero_centered_gamma)
    )
    return y, (x if residual is None else h), None, rstd


def norm_backward(dy, dh_out, h, weight, mean, rstd, zero_centered_gamma, rms, has_bias):
    """``(dh, dweight, None)`` as ``norm_reference.norm_backward``."""
    dh, dweight = torch.ops.mcore_kernels_cpu.rms_norm_backward(
        dy, dh_out, h, weight, rstd, bool(zero_centered_gamma)
    )
    return dh, dweight, None
