"""Import a Hugging Face checkpoint directory into ``GPTModel`` and export it back."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_parallel import ProcessGroupCollection

from ..config.transformer_config import TransformerConfig
from ..models.gpt.model import GPTModel
from ..transformer.process_groups import resolve_process_groups
from .expert_parallel import (
    expert_parallel_group,
    expert_tensor_parallel_group,
    gather_expert_parallel_state,
    gather_expert_tensor_parallel_state,
    local_expert_state,
)
from .io import read_hf_config, read_hf_generation_config, read_hf_weights, write_hf_checkpoint
from .kv_heads import deduplicate_kv_heads, query_groups_for_tp, replicate_kv_heads
from .registry import mapping_for
from .sharding import gather_full_state_dict, load_full_state_dict
from .special_tokens import special_tokens_from_hf, special_tokens_to_hf


def hf_to_transformer_config(hf_config: dict[str, Any], **overrides: Any) -> tuple[TransformerConfig, int]:
    """The ``TransformerConfig`` and (real, unpadded) vocabulary size of an HF ``config.json``;
    ``overrides`` (e.g. ``tensor_model_parallel_size``, ``sequence_parallel``,
    ``make_vocab_size_divisible_by``) win.

    When ``tensor_model_parallel_size`` exceeds the checkpoint's ``num_key_value_heads`` the config
    has ``num_query_groups == tensor_model_parallel_size``: the KV heads are replicated, one per
    rank (see ``mcore_models.hf.kv_heads``).

    Raises:
        ConfigError: the TP size does not divide ``num_attention_heads``, or exceeds the KV heads
            without being a multiple of them (or any other invalid combination).
    """
    kwargs, vocab_size = mapping_for(hf_config.get("model_type", "")).config_from_hf(hf_config)
    known = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown TransformerConfig fields {unknown}")
    if "num_query_groups" not in overrides:
        kwargs["num_query_groups"] = query_groups_for_tp(
            kwargs["num_attention_heads"],
            kwargs.get("num_query_groups") or kwargs["num_attention_heads"],
            overrides.get("tensor_model_parallel_size", 1),
        )
    return TransformerConfig(**(kwargs | overrides)), vocab_size


def import_hf_checkpoint(
    directory: str | Path,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """Build a ``GPTModel`` from an HF checkpoint directory (``config.json`` + ``*.safetensors``).

    Every rank reads the files and keeps its tensor-parallel shard; the TP size is taken from the
    process groups, and any TP size that divides ``num_attention_heads`` works:

    - the vocabulary is padded with zero rows (embedding and output layer) up to
      ``config.padded_vocab_size(vocab_size)``, a multiple of
      ``make_vocab_size_divisible_by`` (an override; default 1) times the TP size. ``model.vocab_size``
      stays the real one and the padded ids are never predicted (see ``GPTModel``);
    - when the TP size exceeds ``num_key_value_heads`` (and is a multiple of it), each KV head is
      copied so every rank holds the one its query heads use: ``config.num_query_groups`` is the
      TP size and the KV cache holds one head per rank.

    MoE experts: with ``expert_model_parallel_size`` (an override, the size of the groups' ``ep``)
    each rank keeps its experts; with ``expert_tensor_parallel_size`` (an override, the size of the
    groups' ``expert_tp``) each rank keeps its slices of each of them, as the layers split them:
    FC1's rows (of the gate and of the up half apiece) and bias, FC2's columns; FC2's bias whole.
    Override sizes that differ from the groups' raise ``ValueError`` (from ``MoELayer``).

    The model is returned in eval mode and remembers its ``hf_model_type`` and
    ``hf_num_key_value_heads`` (what export writes back). Its
    ``bos_token_id``, ``eos_token_ids`` and ``pad_token_id`` come from ``generation_config.json``
    when it names them, else ``config.json``, else the family's ``transformers`` default.
    """
    groups = resolve_process_groups(pg_collection)
    hf_config = read_hf_config(directory)
    config, vocab_size = hf_to_transformer_config(
        hf_config, tensor_model_parallel_size=dist.get_world_size(groups.tp), **config_overrides
    )
    mapping = mapping_for(hf_config["model_type"])
    special_tokens = special_tokens_from_hf(
        hf_config, read_hf_generation_config(directory), mapping.special_token_defaults
    )
    model = GPTModel(config, vocab_size, pg_collection=groups, **special_tokens)
    weights = {name: t.to(torch.float32) for name, t in read_hf_weights(directory).items()}
    hf_kv_heads = hf_config.get("num_key_value_heads") or config.num_attention_heads
    if config.num_query_groups > hf_kv_heads:
        weights = replicate_kv_heads(weights, config.num_query_groups // hf_kv_heads, config.kv_channels)
    state = pad_vocab_rows(mapping.state_from_hf(weights, config), model.padded_vocab_size)
    local_expert_state(model, state)
    load_full_state_dict(model, state, groups.tp)
    model.hf_model_type = mapping.model_type
    model.hf_num_key_value_heads = hf_kv_heads
    return model.eval()


# The state-dict tensors with one row per vocabulary id.
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def pad_vocab_rows(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``state`` with its vocabulary tensors zero-padded to ``rows`` rows (in place; returned)."""
    for name in _VOCAB_ROWS:
        t = state.get(name)
        if t is not None and rows > t.shape[0]:
            state[name] = torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))
    return state


def gather_export_state(model) -> tuple[dict[str, torch.Tensor], list[dist.ProcessGroup]]:
    """``(state, groups)``: the model's whole TP=1 state dict, expert shards gathered and the
    vocabulary padding dropped, on every rank (collective), and the groups it was gathered over:
    the rank that is first in all of them writes, and all wait at a barrier after."""
    ep_group, etp_group = expert_parallel_group(model), expert_tensor_parallel_group(model)
    state = gather_full_state_dict(model, model.tp_group)
    gather_expert_tensor_parallel_state(model, state)
    if ep_group is not None:
        gather_expert_parallel_state(model, state)
    for name in _VOCAB_ROWS:
        if name in state:
            state[name] = state[name][: model.vocab_size]
    return state, [g for g in (model.tp_group, ep_group, etp_group) if g is not None]


def export_hf_checkpoint(
    model: GPTModel,
    directory: str | Path,
    model_type: str | None = None,
    *,
    num_key_value_heads: int | None = None,
) -> None:
    """Write ``model`` as an HF checkpoint ``from_pretrained`` loads (collective over its TP group
    and, with experts split over an expert-tensor-parallel group or spread over an expert-parallel
    group, over those groups too: the slices, then the experts, are gathered one tensor at a time
    and the checkpoint equals an export with every expert whole on one rank (ETP = EP = 1); the
    rank that is rank 0 of each of these groups writes). With data-parallel replicas, call it on
    the ranks that together hold one copy of every weight (with ETP > TP these span several dense
    data-parallel ranks). ``model_type`` defaults to the family the model was imported from. The
    model's special token ids go into ``config.json`` and ``generation_config.json``.

    The vocabulary padding is dropped (``model.vocab_size`` rows). ``num_key_value_heads``
    (default: ``model.hf_num_key_value_heads`` for an imported model, else
    ``config.num_query_groups``) below ``config.num_query_groups`` merges KV heads replicated at
    import back into one each, after checking the copies are still equal (``ValueError`` if not).
    """
    model_type = model_type or getattr(model, "hf_model_type", None)
    if model_type is None:
        raise ValueError("model_type is required for a model that was not imported from Hugging Face")
    mapping = mapping_for(model_type)
    config = model.config
    hf_config = mapping.config_to_hf(config, model.vocab_size)  # validate before communicating
    if num_key_value_heads is not None and num_key_value_heads < 1:
        raise ValueError(f"num_key_value_heads must be >= 1, got {num_key_value_heads}")
    kv_heads = (
        num_key_value_heads or getattr(model, "hf_num_key_value_heads", None) or config.num_query_groups
    )
    if config.num_query_groups % kv_heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) must divide config.num_query_groups ({config.num_query_groups})"
        )
    state, groups = gather_export_state(model)
    weights = mapping.state_to_hf(state, config)
    if kv_heads != config.num_query_groups:  # on every rank, so an error leaves none waiting
        weights = deduplicate_kv_heads(weights, config.num_query_groups // kv_heads, config.kv_channels)
        hf_config["num_key_value_heads"] = kv_heads
    if all(dist.get_rank(g) == 0 for g in groups):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            config.params_dtype
        ]
        special_tokens = special_tokens_to_hf(model)
        hf_config |= {"model_type": model_type, "architectures": [mapping.architecture], "dtype": dtype}
        write_hf_checkpoint(directory, hf_config | special_tokens, weights, special_tokens)
    for group in groups:
        dist.barrier(group=group)
