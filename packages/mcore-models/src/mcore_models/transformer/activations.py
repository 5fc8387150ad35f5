"""MLP activations, plain and gated (``act(gate) * up`` on the two halves of fc1's output)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config.transformer_config import TransformerConfig


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``."""
    return F.relu(x).square()


def quick_gelu(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """``x * sigmoid(alpha * x)``."""
    return x * torch.sigmoid(alpha * x)


_PLAIN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": squared_relu,
    "silu": F.silu,
}


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` on the last-dim halves ``[gate, up]``. The backward writes both halves'
    gradients into one tensor, where autograd of ``chunk`` would ``cat`` them (one more pass and
    allocation of fc1's output size); the values are the same."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        x, activated = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        torch.mul(grad, activated, out=grad_up)
        return grad_x


def activation_function(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function applied to fc1's output: plain, or gated over its last-dim halves ``[gate, up]``."""
    if not config.gated_linear_unit:
        return _PLAIN[config.activation]
    offset, clamp = config.glu_linear_offset, config.activation_clamp_value
    if config.activation == "swiglu" and not offset and clamp is None:
        return _SwiGLU.apply
    gate_fn: Callable[[torch.Tensor], torch.Tensor]
    if config.activation == "swiglu":
        gate_fn = F.silu
    elif config.activation == "geglu":
        gate_fn = F.gelu
    else:
        alpha = config.quick_gelu_alpha

        def gate_fn(x: torch.Tensor) -> torch.Tensor:
            return quick_gelu(x, alpha)

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if clamp is not None:
            gate = gate.clamp(max=clamp)
            up = up.clamp(-clamp, clamp)
        if offset:
            up = up + offset
        return gate_fn(gate) * up

    return gated


def weighted_activation_function(
    config: TransformerConfig,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The activation of ``activation_function(config)`` weighted per row: ``f(x, probs)`` is
    ``act(x) * probs[..., None]`` for ``probs`` of shape ``x.shape[:-1]`` (a routed row's router
    probability), so the probability is applied inside the expert, before fc2: weighted SwiGLU,
    weighted squared ReLU, weighted quick-GeGLU (GPT-OSS's clamped one included) and so on. Without
    an fc2 bias, ``fc2(act(x) * p) == fc2(act(x)) * p``: the same as weighting the expert's output."""
    act = activation_function(config)

    def weighted(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape != x.shape[:-1]:
            raise ValueError(
                f"probs must have shape {tuple(x.shape[:-1])} (one per row), got {tuple(probs.shape)}"
            )
        return act(x) * probs.to(x.dtype).unsqueeze(-1)

    return weighted
