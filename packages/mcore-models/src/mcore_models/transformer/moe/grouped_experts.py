"""``GroupedExperts``: the local experts as one batched matmul per projection."""

from __future__ import annotations

import functools

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
    likewise. On the CPU, where torch has a CPU grouped matmul (``torch._grouped_mm``, torch 2.8
    and later), ``forward`` multiplies each expert's rows in place, grouped by the experts' row
    offsets; elsewhere it scatters the rows into a zero-padded ``[E_local, max_rows, h]`` batch,
    runs ``torch.bmm`` and gathers the real rows back (the padding costs the multiplies of the
    busiest expert's row count for every expert). No Python loop over experts either way. With
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
        if rows.device.type == "cpu" and self._aligned(rows) and grouped_mm_runs(rows.dtype):
            return self._grouped(rows, tokens_per_expert, probs)
        return self._padded(rows, tokens_per_expert, probs)

    def _aligned(self, rows: torch.Tensor) -> bool:
        """Whether rows of the grouped matmul's operands, packed (``_packed_rows``), are 16-byte
        multiples, as ``torch._grouped_mm`` requires."""
        widths = (rows.shape[-1], self.weight1.shape[1], self.weight2.shape[2])
        return all(width * rows.element_size() % 16 == 0 for width in widths)

    def _grouped(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor | None):
        counts = torch.tensor(tokens_per_expert, device=rows.device)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        expert_of_row = None if self.bias1 is None else self._expert_of_row(counts)
        x = torch._grouped_mm(_packed_rows(rows), self.weight1.transpose(1, 2), offs=offsets)
        if self.bias1 is not None:
            x = x + self.bias1[:, 0].index_select(0, expert_of_row)
        x = self.activation(x) if probs is None else self.weighted_activation(x, probs)
        x = torch._grouped_mm(_packed_rows(x), self.weight2.transpose(1, 2), offs=offsets)
        x = _ContiguousGradient.apply(x)
        if self.bias2 is not None:
            x = x + output_bias(self.bias2, self.expert_tp_group)[:, 0].index_select(0, expert_of_row)
        return x

    def _expert_of_row(self, counts: torch.Tensor) -> torch.Tensor:
        """The local expert of each row, rows grouped by expert with ``counts`` rows each."""
        return torch.repeat_interleave(torch.arange(self.num_local_experts, device=counts.device), counts)

    def _padded(self, rows: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor | None):
        experts, device = self.num_local_experts, rows.device
        counts = torch.tensor(tokens_per_expert, device=device)
        longest = max(tokens_per_expert, default=0)
        expert_of_row = self._expert_of_row(counts)
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


def _packed_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its rows back to back from a 16-byte aligned start, as ``torch._grouped_mm``
    needs (the dispatcher may hand over a column slice of a wider buffer): copied only if not."""
    if not x.is_contiguous():
        x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s
    CPU backward refuses the zero-stride gradient of, say, ``out.sum()``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (forward and backward) runs on the CPU in ``dtype`` here (asked
    once per dtype: torch before 2.8 has none, and which dtypes it takes varies), on rows of 16-byte
    multiples."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():  # the first call may come under no_grad (inference)
            return _probe_grouped_mm(dtype)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _probe_grouped_mm(dtype: torch.dtype) -> bool:
    """One tiny grouped matmul, forward and backward (raises where it cannot run)."""
    x = torch.ones(3, 8, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 8, 8, dtype=dtype, requires_grad=True)
    out = torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([1, 3], dtype=torch.int32))
    out.backward(torch.ones_like(out))
    return True
