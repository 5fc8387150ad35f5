"""Initialisers of the Mamba-2 mixer's own parameters (as Megatron-LM's ``MambaMixer``).

Each fills a full master tensor in place from the default generator; the mixer then keeps this
rank's slice (``sharded_parameter``), so the draw is the same at every tensor-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .mamba_config import MambaConfig


@torch.no_grad()
def init_a_log(config: MambaConfig, a_log: torch.Tensor) -> None:
    """``A_log = log(a)``, ``a`` uniform in ``[mamba_a_init_min, mamba_a_init_max]`` (``A = -a``)."""
    a_log.uniform_(config.mamba_a_init_min, config.mamba_a_init_max).log_()


@torch.no_grad()
def init_dt_bias(config: MambaConfig, dt_bias: torch.Tensor) -> None:
    """``dt_bias = softplus^-1(dt)`` with ``dt`` log-uniform in ``[mamba_dt_min, mamba_dt_max]``,
    clamped to at least ``mamba_dt_init_floor``; so ``softplus(dt_bias)`` starts at ``dt``."""
    log_min, log_max = math.log(config.mamba_dt_min), math.log(config.mamba_dt_max)
    dt = torch.exp(torch.rand_like(dt_bias) * (log_max - log_min) + log_min).clamp(
        min=config.mamba_dt_init_floor
    )
    dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


@torch.no_grad()
def init_conv_weight(weight: torch.Tensor) -> None:
    """``torch.nn.Conv1d``'s default: Kaiming-uniform with ``a = sqrt(5)`` (fan-in = kernel width)."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def conv_weight_init(conv_init: float | None) -> Callable[[torch.Tensor], None]:
    """The conv weight's init: uniform in ``±conv_init`` (Megatron-LM's and ``mamba_ssm``'s
    ``conv_init``), or ``init_conv_weight`` (``torch.nn.Conv1d``'s default) when it is ``None``."""
    if conv_init is None:
        return init_conv_weight

    @torch.no_grad()
    def init(weight: torch.Tensor) -> None:
        weight.uniform_(-conv_init, conv_init)

    return init


def conv_bias_init(kernel_width: int) -> Callable[[torch.Tensor], None]:
    """``torch.nn.Conv1d``'s default bias init for a depthwise kernel: uniform in ``±1/sqrt(width)``."""
    bound = 1.0 / math.sqrt(kernel_width)

    @torch.no_grad()
    def init(bias: torch.Tensor) -> None:
        bias.uniform_(-bound, bound)

    return init
