"""Key/value-head replication when the tensor-parallel size exceeds a checkpoint's KV heads.

As vLLM does: with ``tp > num_key_value_heads`` (and ``tp`` a multiple of it) each KV head is
copied ``tp / num_key_value_heads`` times, so the model has ``num_query_groups == tp`` and every TP
rank holds one KV head, the one its query heads attend with. Query head ``h`` of ``n`` belongs to
new group ``h * tp // n``, whose copy is of original head ``h * kv // n``: the same head as before,
so the model computes exactly what the checkpoint does. Export removes the copies again.
"""

from __future__ import annotations

import torch
from mcore_parallel import ConfigError

# The HF tensors holding key/value heads in ``[heads * head_dim, ...]`` rows (Llama-like families).
_KV_SUFFIXES = tuple(f"self_attn.{p}_proj.{k}" for p in "kv" for k in ("weight", "bias"))


def query_groups_for_tp(num_attention_heads: int, num_key_value_heads: int, tp: int) -> int:
    """The ``num_query_groups`` that splits over ``tp`` ranks: the checkpoint's KV heads, or ``tp``
    when ``tp`` exceeds them (replication).

    Raises:
        ConfigError: ``tp`` does not divide ``num_attention_heads``, or exceeds
            ``num_key_value_heads`` without being a multiple of it.
    """
    if num_attention_heads % tp:
        raise ConfigError(
            ["num_attention_heads", "tensor_model_parallel_size"],
            f"the tensor-parallel size ({tp}) must divide num_attention_heads ({num_attention_heads})",
        )
    if num_key_value_heads >= tp:
        return num_key_value_heads  # TransformerConfig checks that tp divides it
    if tp % num_key_value_heads:
        raise ConfigError(
            ["num_query_groups", "tensor_model_parallel_size"],
            f"the tensor-parallel size ({tp}) exceeds num_key_value_heads ({num_key_value_heads}) and "
            f"is not a multiple of it, so the KV heads cannot be replicated one per rank",
        )
    return tp


def _kv_names(weights: dict[str, torch.Tensor]) -> list[str]:
    names = [name for name in weights if name.endswith(_KV_SUFFIXES)]
    if not names:
        raise NotImplementedError("KV-head replication needs separate k_proj/v_proj tensors")
    return names


def replicate_kv_heads(
    weights: dict[str, torch.Tensor], copies: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """HF tensors with every key/value head of every layer repeated ``copies`` times in place."""
    out = dict(weights)
    for name in _kv_names(weights):
        t = weights[name]
        heads = t.reshape(-1, head_dim, *t.shape[1:])
        out[name] = heads.repeat_interleave(copies, dim=0).reshape(-1, *t.shape[1:])
    return out


def deduplicate_kv_heads(
    weights: dict[str, torch.Tensor], copies: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Inverse of ``replicate_kv_heads``: keep the first of each run of ``copies`` heads.

    Raises:
        ValueError: the copies of a head differ (the model was changed after import, e.g. trained:
            each copy gets the gradient of its own query heads), naming the tensor.
    """
    out = dict(weights)
    for name in _kv_names(weights):
        t = weights[name]
        grouped = t.reshape(-1, copies, head_dim, *t.shape[1:])
        first = grouped[:, :1]
        if not torch.equal(grouped, first.expand_as(grouped)):
            diff = (grouped - first).abs().max().item()
            raise ValueError(
                f"{name}: the {copies} copies of each key/value head differ (max abs difference "
                f"{diff:.3g}), so they cannot be merged back; export with num_key_value_heads="
                f"{grouped.shape[0] * copies} to keep every head"
            )
        out[name] = first.reshape(-1, *t.shape[1:])
    return out
