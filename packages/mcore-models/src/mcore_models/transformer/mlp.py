"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config.transformer_config import TransformerConfig
from .activations import activation_function
from .init import init_method, output_init_method
from .spec import build_module


@dataclass
class MLPSubmodules:
    """Specs of ``MLP``'s two projections."""

    linear_fc1: Any = None
    linear_fc2: Any = None


class MLP(torch.nn.Module):
    """``fc2(act(fc1(x)))``. For gated activations fc1 is twice as wide and each TP rank holds
    ``[its gate rows; its up rows]``; such parameters are tagged ``gated_halves = True`` so
    checkpoint conversion shards and gathers the halves separately."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, *, tp_group: dist.ProcessGroup):
        super().__init__()
        common = {
            "tp_group": tp_group,
            "sequence_parallel": config.sequence_parallel,
            "params_dtype": config.params_dtype,
            "bias": config.add_bias_linear,
        }
        width = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        self.linear_fc1 = build_module(
            submodules.linear_fc1, config.hidden_size, width, init_method=init_method(config), **common
        )
        if config.gated_linear_unit:
            for p in self.linear_fc1.parameters():
                _take_gated_slices(p, tp_group)
                p.gated_halves = True
        self.activation = activation_function(config)
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            config.ffn_hidden_size,
            config.hidden_size,
            init_method=output_init_method(config),
            **common,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        output, bias = self.linear_fc2(self.activation(intermediate))
        return output if bias is None else output + bias


def _take_gated_slices(param: torch.nn.Parameter, tp_group: dist.ProcessGroup) -> None:
    """Replace ``param``, this rank's contiguous slice of the master fc1 ``[gate; up]``, by
    ``[its gate slice; its up slice]`` of that master, so that the model is a single process's at
    any TP size (collective over ``tp_group``)."""
    size = dist.get_world_size(tp_group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return
    dim, rank = param.partition_dim, dist.get_rank(tp_group)
    pieces = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(pieces, param.detach().contiguous(), group=tp_group)
    halves = torch.cat(pieces, dim).chunk(2, dim)
    with torch.no_grad():
        param.copy_(torch.cat([half.chunk(size, dim)[rank] for half in halves], dim))
