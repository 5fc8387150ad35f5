"""The Mamba-2 mixer's depthwise causal convolution as a tensor-parallel module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import sharded_parameter

from .block_sharding import blockwise_init
from .causal_conv1d import causal_conv1d, causal_conv1d_step
from .mamba_init import conv_bias_init, conv_weight_init


@experimental_api
class CausalConv1dLayer(torch.nn.Module):
    """Depthwise causal convolution with SiLU over channels made of ``channel_blocks`` (Mamba's
    ``[x; B; C]``), each block split over ``tp_group``.

    ``weight`` ``[channels / tp, 1, kernel_width]`` and ``bias`` ``[channels / tp]`` are named and
    shaped as ``torch.nn.Conv1d``'s (and Megatron-LM's and Hugging Face's ``conv1d``) and drawn
    as its default initialisation of the full layer, except that with ``conv_init`` the weight is
    uniform in ``±conv_init`` (as Megatron-LM's and ``mamba_ssm``'s; the bias keeps the default);
    they are tagged ``partition_blocks``.
    """

    def __init__(
        self,
        channel_blocks: Sequence[int],
        kernel_width: int,
        *,
        tp_group: dist.ProcessGroup,
        params_dtype: torch.dtype,
        conv_init: float | None = None,
    ):
        super().__init__()
        tp_size = dist.get_world_size(tp_group)
        channels = sum(channel_blocks)
        self.weight = sharded_parameter(
            (channels, 1, kernel_width),
            0,
            tp_group,
            blockwise_init(conv_weight_init(conv_init), channel_blocks, tp_size),
            params_dtype,
            None,
        )
        self.bias = sharded_parameter(
            (channels,),
            0,
            tp_group,
            blockwise_init(conv_bias_init(kernel_width), channel_blocks, tp_size),
            params_dtype,
            None,
        )
        for param in (self.weight, self.bias):
            param.partition_blocks = tuple(channel_blocks)

    def forward(
        self, x: torch.Tensor, initial_state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[batch, seqlen, channels / tp]`` -> ``(silu(conv(x)), final_state)``; the state is
        ``[batch, channels / tp, kernel_width - 1]``, the inputs the next token's window needs."""
        return causal_conv1d(
            x, self.weight.squeeze(1), self.bias, initial_state=initial_state, return_final_state=True
        )

    def step(self, conv_state: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token ``x_t`` ``[batch, channels / tp]`` -> ``(output, new_conv_state)``."""
        return causal_conv1d_step(conv_state, x_t, self.weight.squeeze(1), self.bias)
