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
from .io import read_hf_config, read_hf_generation_config, read_hf_weights, write_hf_checkpoint
from .registry import mapping_for
from .sharding import gather_full_state_dict, load_full_state_dict
from .special_tokens import special_tokens_from_hf, special_tokens_to_hf


def hf_to_transformer_config(hf_config: dict[str, Any], **overrides: Any) -> tuple[TransformerConfig, int]:
    """The ``TransformerConfig`` and vocabulary size of an HF ``config.json``; ``overrides`` (e.g.
    ``tensor_model_parallel_size``, ``sequence_parallel``, ``recompute_granularity``) win."""
    kwargs, vocab_size = mapping_for(hf_config.get("model_type", "")).config_from_hf(hf_config)
    known = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown TransformerConfig fields {unknown}")
    return TransformerConfig(**(kwargs | overrides)), vocab_size


def import_hf_checkpoint(
    directory: str | Path,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """Build a ``GPTModel`` from an HF checkpoint directory (``config.json`` + ``*.safetensors``).

    Every rank reads the files and keeps its tensor-parallel shard; the TP size is taken from the
    process groups. The model is returned in eval mode and remembers its ``hf_model_type``. Its
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
    load_full_state_dict(model, mapping.state_from_hf(weights, config), groups.tp)
    model.hf_model_type = mapping.model_type
    return model.eval()


def export_hf_checkpoint(model: GPTModel, directory: str | Path, model_type: str | None = None) -> None:
    """Write ``model`` as an HF checkpoint ``from_pretrained`` loads (collective over its TP group;
    TP rank 0 writes). ``model_type`` defaults to the family the model was imported from. The
    model's special token ids go into ``config.json`` and ``generation_config.json``."""
    model_type = model_type or getattr(model, "hf_model_type", None)
    if model_type is None:
        raise ValueError("model_type is required for a model that was not imported from Hugging Face")
    mapping = mapping_for(model_type)
    hf_config = mapping.config_to_hf(model.config, model.vocab_size)  # validate before communicating
    state = gather_full_state_dict(model, model.tp_group)
    if dist.get_rank(model.tp_group) == 0:
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            model.config.params_dtype
        ]
        special_tokens = special_tokens_to_hf(model)
        hf_config |= {"model_type": model_type, "architectures": [mapping.architecture], "dtype": dtype}
        weights = mapping.state_to_hf(state, model.config)
        write_hf_checkpoint(directory, hf_config | special_tokens, weights, special_tokens)
    dist.barrier(group=model.tp_group)
