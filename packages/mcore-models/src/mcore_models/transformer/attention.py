"""Self-attention: TP-sharded fused QKV projection, qk-norm, RoPE, core attention, output projection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from mcore_kernels import apply_rotary
from mcore_parallel import checkpoint

from ..config.transformer_config import TransformerConfig
from .inference_context import InferenceContext
from .init import init_method, output_init_method
from .spec import build_module


@dataclass
class SelfAttentionSubmodules:
    """Specs of the parts of ``SelfAttention``; norms ``None`` when ``qk_layernorm`` is off."""

    linear_qkv: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    k_layernorm: Any = None


class SelfAttention(torch.nn.Module):
    """Multi-head / grouped-query self-attention on ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism).

    ``linear_qkv`` is column-parallel; its output rows are laid out per query group
    ``[q heads of the group, k, v]``, so splitting rows over TP ranks hands each rank whole groups.
    ``linear_proj`` is row-parallel. ``cp_group`` goes to the core attention (context parallelism).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        *,
        tp_group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp_size = dist.get_world_size(tp_group)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        common = {
            "tp_group": tp_group,
            "sequence_parallel": config.sequence_parallel,
            "params_dtype": config.params_dtype,
        }
        projection_size = config.num_attention_heads * self.head_dim
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            qkv_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=init_method(config),
            **common,
        )
        self.q_layernorm = build_module(submodules.q_layernorm, config, self.head_dim)
        self.k_layernorm = build_module(submodules.k_layernorm, config, self.head_dim)
        for norm in (self.q_layernorm, self.k_layernorm):
            # Shared over heads, which are split over TP ranks: its gradient is a sum over ranks.
            for p in norm.parameters() if norm is not None else ():
                p.sequence_parallel = True
        self.core_attention = build_module(
            submodules.core_attention, config, layer_number, tp_group=tp_group, cp_group=cp_group
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            projection_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            init_method=output_init_method(config),
            **common,
        )

    def grouped_qkv(self, mixed: torch.Tensor) -> torch.Tensor:
        """``linear_qkv``'s output ``[..., (n + 2g) d]`` as ``[..., g, n/g + 2, d]``: each key group's
        query heads, then its key head, then its value head (a view)."""
        per_group = self.num_heads // self.num_groups
        return mixed.view(*mixed.shape[:-1], self.num_groups, per_group + 2, self.head_dim)

    def split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, (n + 2g) d]`` -> ``q [s, b, n, d]``, ``k, v [s, b, g, d]``.

        One ``split`` (not three slices): its backward writes the three gradients into one tensor.
        """
        s, b, _ = mixed.shape
        per_group = self.num_heads // self.num_groups
        grouped = self.grouped_qkv(mixed)
        query, key, value = grouped.split([per_group, 1, 1], dim=3)
        return query.reshape(s, b, self.num_heads, self.head_dim), key.squeeze(3), value.squeeze(3)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        mixed, _ = self.linear_qkv(hidden_states)
        query, key, value = self.split_qkv(mixed)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if rotary is not None:
            cos, sin = rotary
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if inference_context is not None:
            context = self.core_attention(query, key, value, inference_context=inference_context)
        elif self.config.recompute_granularity == "selective" and self.training:
            context = checkpoint(self.core_attention, query, key, value, segment_ids, attention_mask)
        else:
            context = self.core_attention(query, key, value, segment_ids, attention_mask)
        output, bias = self.linear_proj(context)
        return output if bias is None else output + bias
