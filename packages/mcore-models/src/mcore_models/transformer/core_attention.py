"""Scaled dot-product attention in plain PyTorch, with GQA, windows and sink softmax."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config.transformer_config import TransformerConfig
from .attention_mask import allowed_keys
from .context_parallel import context_parallel_attention
from .inference_context import InferenceContext
from .masked_attention import masked_attention, sink_softmax
from .rng import tensor_parallel_rng

__all__ = ["DotProductAttention", "sink_softmax"]


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

    With ``cp_group`` (context parallelism, more than one rank) the inputs hold this rank's tokens
    of a sequence split by ``context_parallel.split_sequence`` and the keys and values of the
    other ranks are exchanged as ``config.cp_comm_type`` says (see ``context_parallel_attention``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        *,
        tp_group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.window_size = config.window_for_layer(layer_number)
        self.tp_group = tp_group
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
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

    def attend_cached(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inference_context: InferenceContext
    ) -> torch.Tensor:
        """Inference on a step's tokens as rows: writes ``key, value [t, g, d]`` into
        ``inference_context``'s cache of this layer and attends ``query [t, n, d]`` over it
        (this layer's scale, window and sinks); ``[t, n * d]``."""
        if self.cp_group is not None:
            raise ValueError(
                "inference_context does not support context parallelism (context_parallel_size > 1)"
            )
        return inference_context.attend(
            self.layer_number,
            query,
            key,
            value,
            scale=self.scale,
            window_size=self.window_size,
            sink_logits=self.sink_logits(query.shape[1], query.device),
        )

    def _fused(self, attention_mask: torch.Tensor | None) -> bool:
        """Causal attention, packed or not, without window, sink, extra mask or active dropout goes
        through PyTorch's fused ``scaled_dot_product_attention``: same result, less memory and time
        (packed sequences with a boolean mask of each query's own document)."""
        return (
            self.cp_group is None
            and self.config.softmax_type == "vanilla"
            and self.window_size is None
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
            return self.attend_cached(query[:, 0], key[:, 0], value[:, 0], inference_context).unsqueeze(1)
        if self._fused(attention_mask):
            mask = None if segment_ids is None else allowed_keys(s, segment_ids=segment_ids)
            if mask is not None and b > 1:  # each row's documents, in the [1, b * heads] layout
                mask = mask.expand(b, n, s, s).reshape(1, b * n, s, s)
            context = torch.nn.functional.scaled_dot_product_attention(
                _batch_in_heads(query),
                # Keys and values are read once per block of queries, faster from contiguous rows
                # than from rows b * h * d apart: the two copies pay for themselves.
                _batch_in_heads(key).contiguous(),
                _batch_in_heads(value).contiguous(),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            return context.permute(2, 0, 1, 3).reshape(s, b, n * d)
        if self.cp_group is not None:
            if segment_ids is not None or attention_mask is not None:
                raise ValueError(
                    "context parallelism does not support packed sequences or an extra attention_mask"
                )
            return context_parallel_attention(
                query,
                key,
                value,
                cp_group=self.cp_group,
                comm_type=self.config.cp_comm_type,
                scale=self.scale,
                window_size=self.window_size,
                sink_logits=self.sink_logits(n, query.device),
                dropout=self._active_dropout(),
            ).reshape(s, b, n * d)
        allowed = allowed_keys(s, window_size=self.window_size, segment_ids=segment_ids, device=query.device)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask
        context = masked_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            allowed,
            scale=self.scale,
            sink_logits=self.sink_logits(n, query.device),
            dropout=self._active_dropout(),
        )  # [b, n, s, d]
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)

    def _active_dropout(self):
        """Dropout of attention probabilities (on the tensor-parallel stream), ``None`` when off."""
        return self._dropout if self.training and self.dropout.p > 0 else None

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        with tensor_parallel_rng(self.tp_group):
            return self.dropout(probs)
