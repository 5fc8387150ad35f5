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
        gated = config.gated_linear_unit
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            config.hidden_size,
            config.ffn_hidden_size * (2 if gated else 1),
            init_method=init_method(config),
            **common,
            **({"stride": 2} if gated else {}),
        )
        if gated:
            for p in self.linear_fc1.parameters():
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
