"""``attention_softmax``: the public entry point, an autograd function over the Triton kernel
(``dispatch``; the reference is differentiated by autograd), and the checks that turn bad arguments
into errors naming them."""

from __future__ import annotations

import importlib
import math

import torch

from . import softmax_reference
from .dispatch import select_backend


class _TritonSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, sink_logits, allowed, scale, causal, window_size):
        kernels = importlib.import_module("mcore_kernels.softmax_triton")
        mask = None
        if allowed is not None:
            mask = allowed.expand(scores.shape).to(torch.int8).contiguous()
        sink = None if sink_logits is None else sink_logits.contiguous()
        probs, p_sink = kernels.softmax_forward(scores.contiguous(), scale, causal, window_size, sink, mask)
        ctx.save_for_backward(probs, p_sink)
        ctx.scale = scale
        ctx.sink_dtype = None if sink_logits is None else sink_logits.dtype
        return probs

    @staticmethod
    def backward(ctx, dprobs):
        probs, p_sink = ctx.saved_tensors
        kernels = importlib.import_module("mcore_kernels.softmax_triton")
        dscores, dsink_rows = kernels.softmax_backward(dprobs.contiguous(), probs, p_sink, ctx.scale)
        dsink = None
        if dsink_rows is not None:
            n, q = probs.shape[-3], probs.shape[-2]
            dsink = dsink_rows.view(-1, n, q).sum((0, 2)).to(ctx.sink_dtype)
        return dscores, dsink, None, None, None, None


def _check_tensors(scores, sink_logits, allowed) -> None:
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError(f"attention_softmax: scores must be a floating-point tensor, got {_kind(scores)}")
    if scores.dim() < 2:
        raise ValueError(f"attention_softmax: scores must be [..., q, k], got shape {tuple(scores.shape)}")
    if sink_logits is not None:
        if not isinstance(sink_logits, torch.Tensor) or not sink_logits.is_floating_point():
            raise TypeError(
                f"attention_softmax: sink_logits must be a floating-point tensor, got {_kind(sink_logits)}"
            )
        heads = scores.shape[-3] if scores.dim() >= 3 else None
        if heads is None or tuple(sink_logits.shape) != (heads,) or sink_logits.device != scores.device:
            raise ValueError(
                "attention_softmax: sink_logits must have shape (n,) for scores [..., n, q, k] on "
                f"{scores.device}, got {tuple(sink_logits.shape)} on {sink_logits.device} for scores "
                f"{tuple(scores.shape)}"
            )
    if allowed is not None:
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise TypeError(f"attention_softmax: allowed must be a bool tensor, got {_kind(allowed)}")
        try:
            if torch.broadcast_shapes(allowed.shape, scores.shape) != scores.shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"attention_softmax: allowed {tuple(allowed.shape)} must broadcast to scores "
                f"{tuple(scores.shape)}"
            ) from None
        if allowed.device != scores.device:
            raise ValueError(f"attention_softmax: allowed must be on {scores.device}, got {allowed.device}")


def _kind(value) -> str:
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_options(scale, causal, window_size) -> None:
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"attention_softmax: scale must be a finite number > 0, got {scale!r}")
    if window_size is None:
        return
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(
            f"attention_softmax: window_size must be a positive int or None, got {window_size!r}"
        )
    if not causal:
        raise ValueError(
            "attention_softmax: window_size needs causal=True (the window reaches back from the query)"
        )


def attention_softmax(
    scores: torch.Tensor,
    *,
    scale: float = 1.0,
    causal: bool = False,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax over the last dimension of ``scores [..., n, q, k] * scale`` (the last ``q`` queries
    of ``k`` keys, ``n`` heads), over the keys ``allowed`` (bool, broadcast to ``scores``) lets each
    query see and, with ``causal``, those at or before it, with ``window_size`` fewer than
    ``window_size`` back. ``sink_logits [n]`` join each head's denominator (zeros: the off-by-one
    softmax; learnable ones get a gradient). Float32 inside, ``scores``' dtype out; a row with
    nothing to attend to is zeros. Differentiable in ``scores`` and ``sink_logits``."""
    _check_tensors(scores, sink_logits, allowed)
    _check_options(scale, causal, window_size)
    backend = select_backend("attention_softmax", scores)
    if backend == "reference" or scores.numel() == 0:
        return softmax_reference.attention_softmax(
            scores, float(scale), bool(causal), window_size, sink_logits, allowed
        )
    return _TritonSoftmaxFunction.apply(scores, sink_logits, allowed, float(scale), bool(causal), window_size)
