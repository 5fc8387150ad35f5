"""Mamba-2's gated RMSNorm as a tensor-parallel module."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import sharded_parameter

from .gated_rms_norm import gated_rms_norm


@experimental_api
class GatedRMSNormLayer(torch.nn.Module):
    """``rmsnorm(x * silu(z)) * weight`` (``norm_before_gate=False``, as Mamba-2), normalised over
    runs of ``group_size`` channels. ``weight`` (ones) is this rank's ``channels / tp`` slice; the
    groups must not straddle ranks, so ``group_size`` must divide ``channels / tp``."""

    def __init__(
        self,
        channels: int,
        *,
        group_size: int,
        eps: float,
        tp_group: dist.ProcessGroup,
        params_dtype: torch.dtype,
    ):
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = sharded_parameter((channels,), 0, tp_group, torch.nn.init.ones_, params_dtype, None)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, eps=self.eps, group_size=self.group_size)
