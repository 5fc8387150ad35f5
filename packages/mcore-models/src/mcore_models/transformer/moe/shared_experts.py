"""``SharedExpertMLP``: an MLP every token passes through beside the routed experts."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ..init import init_method
from ..mlp import MLP, MLPSubmodules


@experimental_api
class SharedExpertMLP(MLP):
    """``MLP`` of width ``config.moe_shared_expert_intermediate_size``; with
    ``config.moe_shared_expert_gate`` its output is scaled by ``sigmoid(x @ gate_weight.T)``, one
    scalar per token (Qwen2-MoE's ``shared_expert_gate``)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, *, tp_group: dist.ProcessGroup):
        size = config.moe_shared_expert_intermediate_size
        if size is None:
            raise ValueError("SharedExpertMLP needs config.moe_shared_expert_intermediate_size")
        super().__init__(dataclasses.replace(config, ffn_hidden_size=size), submodules, tp_group=tp_group)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty(1, config.hidden_size, dtype=config.params_dtype)
            )
            init_method(config)(self.gate_weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden_states)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output
