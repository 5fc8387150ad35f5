"""Depthwise causal 1-D convolution of the Mamba-2 mixer, over a whole sequence or one decode step.

Output ``t`` of channel ``c`` is ``bias[c] + sum_k weight[c, k] * u[t - (kernel_width - 1) + k]``
where ``u`` is the input preceded by the carried state (the ``kernel_width - 1`` inputs before the
sequence, zeros if none), so ``weight[:, -1]`` multiplies the current token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mcore_api import experimental_api

from ._shapes import compute_dtype
from .cuda_kernels import conv_kernel

ACTIVATIONS = ("silu", None)


@experimental_api
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x`` ``[batch, seqlen, channels]`` with ``weight``
    ``[channels, kernel_width]`` and optional ``bias`` ``[channels]``, then ``activation``
    (``"silu"`` or ``None``).

    ``initial_state`` ``[batch, channels, kernel_width - 1]`` holds the inputs just before ``x``
    (zeros if omitted). Returns ``y`` ``[batch, seqlen, channels]`` in ``x``'s dtype (computed in
    float32 or wider), and with ``return_final_state`` the last ``kernel_width - 1`` inputs,
    ``[batch, channels, kernel_width - 1]`` in ``x``'s dtype, taken from ``initial_state`` (or zeros)
    where the sequence is shorter than that. On CUDA with ``causal_conv1d`` installed its kernel
    computes it (``cuda_kernels``; the PyTorch path keeps a final state longer than the sequence).
    """
    if x.dim() != 3:
        raise ValueError(f"x must have 3 dimensions [batch, seqlen, channels]; got shape {list(x.shape)}")
    batch, _, channels = x.shape
    width = _check_conv_params(weight, bias, activation, channels, f"x of shape {list(x.shape)}")
    dtype = compute_dtype(x, weight, bias, initial_state)
    if initial_state is not None:
        _check_state("initial_state", initial_state, batch, channels, width)
    kernel = conv_kernel(width, x, weight, bias, initial_state)
    if kernel is not None and (x.shape[1] >= width - 1 or not return_final_state):
        return _run_kernel(kernel, x, weight, bias, activation, initial_state, return_final_state)
    if initial_state is None:
        history = x.new_zeros(batch, channels, width - 1, dtype=dtype)
    else:
        history = initial_state.to(dtype)
    padded = torch.cat([history, x.transpose(1, 2).to(dtype)], dim=-1)  # [batch, channels, width-1+seqlen]
    bias_f = None if bias is None else bias.to(dtype)
    y = F.conv1d(padded, weight.to(dtype).unsqueeze(1), bias_f, groups=channels)
    y = _activate(y, activation).transpose(1, 2).to(x.dtype)
    if return_final_state:
        final_state = padded[..., padded.shape[-1] - (width - 1) :].to(x.dtype)
        return y, final_state
    return y


def _run_kernel(kernel, x, weight, bias, activation, initial_state, return_final_state):
    """``causal_conv1d`` through ``causal_conv1d``'s CUDA kernel (``cuda_kernels``): ``x`` and the
    state handed over channel-last, the results in ``causal_conv1d``'s layouts and dtypes."""
    channels_last = x.contiguous().transpose(1, 2)  # [b, channels, s], stride 1 along channels
    if initial_state is not None:
        initial_state = initial_state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    result = kernel(
        channels_last,
        weight,
        bias,
        initial_states=initial_state,
        return_final_states=return_final_state,
        activation=activation,
    )
    if return_final_state:
        y, final_state = result
        return y.transpose(1, 2).to(x.dtype), final_state.to(x.dtype)
    return result.transpose(1, 2).to(x.dtype)


@experimental_api
def causal_conv1d_step(
    conv_state: torch.Tensor,
    x_t: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of :func:`causal_conv1d`: ``conv_state`` ``[batch, channels, kernel_width - 1]``
    (the previous inputs, oldest first) and ``x_t`` ``[batch, channels]``.

    Returns ``(y_t, new_conv_state)``: ``y_t`` ``[batch, channels]`` in ``x_t``'s dtype and the
    state shifted by one token, in ``conv_state``'s dtype. ``conv_state`` is left unchanged.
    """
    if x_t.dim() != 2:
        raise ValueError(f"x_t must have 2 dimensions [batch, channels]; got shape {list(x_t.shape)}")
    batch, channels = x_t.shape
    width = _check_conv_params(weight, bias, activation, channels, f"x_t of shape {list(x_t.shape)}")
    _check_state("conv_state", conv_state, batch, channels, width)
    dtype = compute_dtype(conv_state, x_t, weight, bias)
    window = torch.cat(
        [conv_state.to(dtype), x_t.to(dtype).unsqueeze(-1)], dim=-1
    )  # [batch, channels, width]
    y = (window * weight.to(dtype)).sum(dim=-1)
    if bias is not None:
        y = y + bias.to(dtype)
    return _activate(y, activation).to(x_t.dtype), window[..., 1:].to(conv_state.dtype)


def _check_conv_params(
    weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, channels: int, source: str
) -> int:
    """Validate ``weight``, ``bias`` and ``activation`` against ``channels``; return the kernel width."""
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"weight must have shape [channels, kernel_width] = [{channels}, >=1] to match {source}; "
            f"got {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(
            f"bias must have shape [channels] = [{channels}] to match {source}; got {list(bias.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}; got {activation!r}")
    return weight.shape[1]


def _check_state(name: str, state: torch.Tensor, batch: int, channels: int, width: int) -> None:
    expected = (batch, channels, width - 1)
    if tuple(state.shape) != expected:
        raise ValueError(
            f"{name} must have shape [batch, channels, kernel_width - 1] = {list(expected)}; "
            f"got {list(state.shape)}"
        )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y
