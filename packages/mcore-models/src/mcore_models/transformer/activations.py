"""MLP activations, plain and gated (``act(gate) * up`` on the two halves of fc1's output). The gated
ones and squared ReLU are mcore-kernels' fused ops (their Triton kernels on CUDA); the other plain
ones are torch's."""

from __future__ import annotations

import functools
from collections.abc import Callable

import mcore_kernels
import torch
import torch.nn.functional as F

from ..config.transformer_config import TransformerConfig

Activation = Callable[..., torch.Tensor]

_TORCH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _fused(config: TransformerConfig) -> Activation | None:
    """mcore-kernels' op for ``config`` as ``f(x, probs=None)``, or ``None`` for torch's plain ones."""
    if config.activation == "squared_relu":
        return mcore_kernels.squared_relu
    if not config.gated_linear_unit:
        return None
    options = {"offset": config.glu_linear_offset, "clamp": config.activation_clamp_value}
    if config.activation == "swiglu":
        return functools.partial(mcore_kernels.swiglu, **options)
    if config.activation == "geglu":
        return functools.partial(mcore_kernels.geglu, **options)
    return functools.partial(mcore_kernels.quick_geglu, alpha=config.quick_gelu_alpha, **options)


def activation_function(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function applied to fc1's output: plain, or gated over its last-dim halves ``[gate, up]``."""
    fused = _fused(config)
    return _TORCH[config.activation] if fused is None else fused


def weighted_activation_function(
    config: TransformerConfig,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The activation of ``activation_function(config)`` weighted per row: ``f(x, probs)`` is
    ``act(x) * probs[..., None]`` for ``probs`` of shape ``x.shape[:-1]`` (a routed row's router
    probability), so the probability is applied inside the expert, before fc2: weighted SwiGLU,
    weighted squared ReLU, weighted quick-GeGLU (GPT-OSS's clamped one included) and so on. Without
    an fc2 bias, ``fc2(act(x) * p) == fc2(act(x)) * p``: the same as weighting the expert's output."""
    fused = _fused(config)

    def weighted(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape != x.shape[:-1]:
            raise ValueError(
                f"probs must have shape {tuple(x.shape[:-1])} (one per row), got {tuple(probs.shape)}"
            )
        if fused is None:
            return _TORCH[config.activation](x) * probs.to(x.dtype).unsqueeze(-1)
        return fused(x, probs)

    return weighted
