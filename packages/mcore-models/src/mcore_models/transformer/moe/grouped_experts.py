"""``GroupedExperts``: the local experts as one batched matmul per projection."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ..activations import activation_function, weighted_activation_function
from ..init import init_method, output_init_method
from .expert_sharding import expert_tp_size, mark_sharded, output_bias, sharded_width


@experimental_api
class GroupedExperts(torch.nn.Module):
    """The same experts as ``SequentialExperts``, weights stacked per projection: ``weight1``
    ``[E_local, width, h]`` and ``weight2`` ``[E_local, h, ffn]`` (expert ``e``'s slice is
    ``SequentialExperts.local_experts[e].linear_fc{1,2}.weight``), biases ``bias1``/``bias2``
    likewise. ``forward`` scatters the rows into a zero-padded ``[E_local, max_rows, h]`` batch,
    runs ``torch.bmm`` and gathers the real rows back: no Python loop over experts. With
    ``probs [rows]`` the activation is weighted per row, as in ``SequentialExperts``. With an
    ``expert_tp_group`` of size ``P`` this rank holds ``1/P`` of each expert's hidden width (see
    ``expert_sharding``) and returns its partial output."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        num_local_experts: int,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.expert_tp_group = expert_tp_group
        ffn = sharded_width(config.moe_ffn_hidden_size, expert_tp_group)
        width = ffn * (2 if config.gated_linear_unit else 1)
        h, dtype = config.hidden_size, config.params_dtype
        self.num_local_experts = num_local_experts
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, width, h, dtype=dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, h, ffn, dtype=dtype))
        init_method(config)(self.weight1)
        output_init_method(config)(self.weight2)
        if config.add_bias_linear:
            self.bias1 = torch.nn.Parameter(torch.zeros(num_local_experts, 1, width, dtype=dtype))
            self.bias2 = torch.nn.Parameter(torch.zeros(num_local_experts, 1, h, dtype=dtype))
        else:
            self.bias1 = self.bias2 = None
        if expert_tp_size(expert_tp_group) > 1:
            mark_sharded(self.weight1, 1, config.gated_linear_unit)
            if self.bias1 is not None:
                mark_sharded(self.bias1, 2, config.gated_linear_unit)
            mark_sharded(self.weight2, 2)
        self.activation = activation_function(config)
        self.weighted_activation = weighted_activation_function(config)

    def forward(
        self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        experts, device = self.num_local_experts, rows.device
        counts = torch.tensor(tokens_per_expert, device=device)
        longest = max(tokens_per_expert, default=0)
        expert_of_row = torch.repeat_interleave(torch.arange(experts, device=device), counts)
        start = torch.cumsum(counts, 0) - counts
        slot = expert_of_row * longest + torch.arange(rows.shape[0], device=device) - start[expert_of_row]
        batch = rows.new_zeros(experts * longest, rows.shape[-1]).index_copy(0, slot, rows)
        x = torch.bmm(batch.view(experts, longest, -1), self.weight1.transpose(1, 2))
        if self.bias1 is not None:
            x = x + self.bias1
        if probs is None:
            x = self.activation(x)
        else:
            batch_probs = probs.new_zeros(experts * longest).index_copy(0, slot, probs)
            x = self.weighted_activation(x, batch_probs.view(experts, longest))
        x = torch.bmm(x, self.weight2.transpose(1, 2))
        if self.bias2 is not None:
            x = x + output_bias(self.bias2, self.expert_tp_group)
        return x.reshape(experts * longest, -1).index_select(0, slot)
