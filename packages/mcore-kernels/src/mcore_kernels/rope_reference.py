"""Rotary position embedding in plain PyTorch: the numerical oracle of the Triton kernel and the
path every non-CUDA tensor takes. The backward is the transposed rotation (no autograd graph, no
``cat``), so only the cos/sin tables are kept for it.

Inputs are rows ``x [R, d]`` and tables ``cos, sin [C, r]`` (``r <= d`` even, the rotary
dimensions); rows ``i * group ... (i + 1) * group - 1`` of ``x`` (e.g. the heads of one token) use
table row ``i``. The first ``r`` dimensions of a row are rotated in pairs and the rest pass through.
Pairs are ``(j, j + r/2)`` in the half-split layout and ``(2j, 2j + 1)`` in the interleaved one; a
pair ``(a, b)`` with table entries ``(cos_a, cos_b)``, ``(sin_a, sin_b)`` becomes
``(a cos_a - b sin_a, b cos_b + a sin_b)``, which is the rotation of ``a + ib`` by the pair's angle
when both entries of the pair hold the same angle (as ``rope_cos_sin`` builds them). Arithmetic is
in float32 (float64 for float64 inputs); the output is rounded once to ``x``'s dtype.
"""

from __future__ import annotations

import torch


def _pairs(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    return t.chunk(2, dim=-1)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, transpose: bool
) -> torch.Tensor:
    """The rotation of ``x [R, d]`` by ``cos, sin [C, r]`` (rows grouped as in the module doc), or
    with ``transpose`` its transpose, which is the backward: ``(a cos_a + b sin_b, b cos_b - a sin_a)``."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    rows, width = x.shape
    tables, rotary = cos.shape
    xf = x.to(dtype).view(tables, rows // max(tables, 1), width)
    cos_a, cos_b = _pairs(cos.to(dtype).unsqueeze(1), interleaved)
    sin_a, sin_b = _pairs(sin.to(dtype).unsqueeze(1), interleaved)
    out = xf.clone()
    a, b = _pairs(xf[..., :rotary], interleaved)
    out_a, out_b = _pairs(out[..., :rotary], interleaved)
    if transpose:
        out_a.copy_(a * cos_a + b * sin_b)
        out_b.copy_(b * cos_b - a * sin_a)
    else:
        out_a.copy_(a * cos_a - b * sin_a)
        out_b.copy_(b * cos_b + a * sin_b)
    return out.view(rows, width).to(x.dtype)
