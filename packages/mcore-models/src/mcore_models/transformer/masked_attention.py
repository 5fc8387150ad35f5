"""Attention of queries over keys under a boolean mask, with optional sink logits and dropout."""

from __future__ import annotations

from collections.abc import Callable

import torch
from mcore_kernels import attention_softmax


def sink_softmax(scores: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores [b, n, q, k]`` with one extra logit per head.

    The sink ``sink_logits [n]`` joins the denominator and takes probability mass, but has no value:
    ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``. A sink of 0 is the off-by-one softmax.
    """
    return attention_softmax(scores, sink_logits=sink_logits)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scale: float,
    sink_logits: torch.Tensor | None = None,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale)`` over the ``allowed`` keys (mcore-kernels' ``attention_softmax``; a
    query with no allowed key and no sink gets zeros), times ``v``; scores in float32.

    ``query [b, n, q, d]``, ``key, value [b, g, k, d]`` (query head ``i`` uses key head
    ``i // (n / g)``), ``allowed`` boolean, broadcastable to ``[b, n, q, k]``. ``sink_logits [n]``
    select the sink softmax; ``dropout`` is applied to the probabilities. Returns ``[b, n, q, d]``.
    """
    repeats = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(repeats, dim=1)
    value = value.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float()
    probs = attention_softmax(scores, scale=scale, allowed=allowed, sink_logits=sink_logits)
    probs = probs.to(value.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, value)
