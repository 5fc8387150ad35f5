"""``SequentialExperts``: the local experts as a loop of small MLPs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ..activations import activation_function, weighted_activation_function
from ..init import init_method, output_init_method
from .expert_sharding import expert_tp_size, mark_sharded, output_bias, sharded_width


class ExpertMLP(torch.nn.Module):
    """One expert: ``fc2(act(fc1(x)))``; for gated activations fc1's rows are ``[gate; up]``.
    Given per-row ``probs``, ``fc2(act(fc1(x)) * probs)`` (the weighted activation). With an
    ``expert_tp_group`` of size ``P`` this rank holds ``1/P`` of the hidden width (see
    ``expert_sharding``) and returns its partial output, to be summed over the group."""

    def __init__(
        self,
        config: TransformerConfig,
        ffn_hidden_size: int,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.expert_tp_group = expert_tp_group
        ffn_hidden_size = sharded_width(ffn_hidden_size, expert_tp_group)
        width = ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        kwargs = {"bias": config.add_bias_linear, "dtype": config.params_dtype}
        self.linear_fc1 = torch.nn.Linear(config.hidden_size, width, **kwargs)
        self.linear_fc2 = torch.nn.Linear(ffn_hidden_size, config.hidden_size, **kwargs)
        init_method(config)(self.linear_fc1.weight)
        output_init_method(config)(self.linear_fc2.weight)
        for linear in (self.linear_fc1, self.linear_fc2):
            if linear.bias is not None:
                torch.nn.init.zeros_(linear.bias)
        if expert_tp_size(expert_tp_group) > 1:
            mark_sharded(self.linear_fc1.weight, 0, config.gated_linear_unit)
            if self.linear_fc1.bias is not None:
                mark_sharded(self.linear_fc1.bias, 0, config.gated_linear_unit)
            mark_sharded(self.linear_fc2.weight, 1)
        self.activation = activation_function(config)
        self.weighted_activation = weighted_activation_function(config)

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.linear_fc1(x)
        hidden = self.activation(hidden) if probs is None else self.weighted_activation(hidden, probs)
        bias = self.linear_fc2.bias
        if bias is None or expert_tp_size(self.expert_tp_group) == 1:
            return self.linear_fc2(hidden)
        return F.linear(hidden, self.linear_fc2.weight) + output_bias(bias, self.expert_tp_group)


@experimental_api
class SequentialExperts(torch.nn.Module):
    """``num_local_experts`` ``ExpertMLP``s of width ``config.moe_ffn_hidden_size``; ``forward``
    takes rows grouped by expert (``tokens_per_expert`` rows each) and runs each group through its
    expert in turn. With ``probs [rows]`` (each row's router probability) the experts apply
    the weighted activation (see ``MoELayer`` and ``config.moe_weighted_activation``). With an
    ``expert_tp_group`` each expert is split over it (``ExpertMLP``)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        num_local_experts: int,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(
            ExpertMLP(config, config.moe_ffn_hidden_size, expert_tp_group) for _ in range(num_local_experts)
        )

    def forward(
        self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        chunks = rows.split(tokens_per_expert)
        if probs is None:
            outputs = [expert(chunk) for expert, chunk in zip(self.local_experts, chunks, strict=True)]
        else:
            outputs = [
                expert(chunk, p)
                for expert, chunk, p in zip(
                    self.local_experts, chunks, probs.split(tokens_per_expert), strict=True
                )
            ]
        return torch.cat(outputs)
