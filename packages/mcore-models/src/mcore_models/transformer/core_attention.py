"""Scaled dot-product attention in plain PyTorch, with GQA, windows and sink softmax."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config.transformer_config import TransformerConfig
from .attention_mask import allowed_keys
from .inference_context import InferenceContext
from .rng import tensor_parallel_rng


def sink_softmax(scores: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores [b, n, q, k]`` with one extra logit per head.

    The sink ``sink_logits [n]`` joins the denominator and takes probability mass, but has no value:
    ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``. A sink of 0 is the off-by-one softmax.
    """
    b, n, q, _ = scores.shape
    sink = sink_logits.to(scores.dtype).view(1, n, 1, 1).expand(b, n, q, 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def _batch_in_heads(x: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[1, b * h, s, d]``, a view when ``b`` and ``h`` are adjacent in memory.

    Without masks the batch is just more heads. Queries in this layout are read in place and the
    output comes out already laid out as ``[s, b, h, d]``; query head ``i`` still meets key head
    ``i // (n / g)`` under ``enable_gqa``.
    """
    s, b, h, d = x.shape
    return x.reshape(s, 1, b * h, d).permute(1, 2, 0, 3)


class DotProductAttention(torch.nn.Module):
    """``softmax(q k^T * scale + mask) v`` for this rank's heads.

    Inputs ``q [s, b, n, d]``, ``k, v [s, b, g, d]`` (``g`` groups, ``n / g`` queries each);
    output ``[s, b, n * d]``. ``softmax_type="learnable"`` holds ``softmax_offset [n]``, this
    rank's slice of the per-head sink logits (zeros at init).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, *, tp_group: dist.ProcessGroup):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.window_size = config.window_for_layer(layer_number)
        self.tp_group = tp_group
        tp_size = dist.get_world_size(tp_group)
        self.num_heads = config.num_attention_heads // tp_size
        self.scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = torch.nn.Dropout(config.attention_dropout)
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=config.params_dtype))
            self.softmax_offset.tensor_model_parallel = True
            self.softmax_offset.partition_dim = 0
        else:
            self.softmax_offset = None

    def sink_logits(self, num_heads: int, device: torch.device) -> torch.Tensor | None:
        """Float32 sink logit per head ``[num_heads]`` (zeros for off-by-one), ``None`` for vanilla softmax."""
        if self.config.softmax_type == "vanilla":
            return None
        if self.config.softmax_type == "off-by-one":
            return torch.zeros(num_heads, device=device)
        return self.softmax_offset.float()

    def _fused_causal(self, segment_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
        """Plain causal attention (no window, sink, packing, extra mask or active dropout) goes
        through PyTorch's fused ``scaled_dot_product_attention``: same result, less memory and time."""
        return (
            self.config.softmax_type == "vanilla"
            and self.window_size is None
            and segment_ids is None
            and attention_mask is None
            and not (self.training and self.dropout.p > 0)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        s, b, n, d = query.shape
        if inference_context is not None:  # one flattened row: the context attends over its cache
            context = inference_context.attend(
                self.layer_number,
                query[:, 0],
                key[:, 0],
                value[:, 0],
                scale=self.scale,
                window_size=self.window_size,
                sink_logits=self.sink_logits(n, query.device),
            )
            return context.unsqueeze(1)
        if self._fused_causal(segment_ids, attention_mask):
            context = torch.nn.functional.scaled_dot_product_attention(
                _batch_in_heads(query),
                # Keys and values are read once per block of queries, faster from contiguous rows
                # than from rows b * h * d apart: the two copies pay for themselves.
                _batch_in_heads(key).contiguous(),
                _batch_in_heads(value).contiguous(),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )
            return context.permute(2, 0, 1, 3).reshape(s, b, n * d)
        repeats = n // key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3).repeat_interleave(repeats, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(repeats, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        allowed = allowed_keys(s, window_size=self.window_size, segment_ids=segment_ids, device=q.device)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = self.sink_logits(n, scores.device)
        probs = torch.softmax(scores, dim=-1) if sinks is None else sink_softmax(scores, sinks)
        probs = probs.to(v.dtype)
        if self.training and self.dropout.p > 0:
            with tensor_parallel_rng(self.tp_group):
                probs = self.dropout(probs)
        context = torch.matmul(probs, v)  # [b, n, s, d]
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)
