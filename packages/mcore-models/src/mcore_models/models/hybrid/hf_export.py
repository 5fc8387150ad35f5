"""What every Hugging Face hybrid export shares: gather the shards, map them to the family's
tensors, and write them with the config from the rank that is rank 0 of every group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...config.transformer_config import TransformerConfig
from ...hf.checkpoint import gather_export_state
from ...hf.io import write_hf_checkpoint
from ...hf.special_tokens import special_tokens_to_hf
from .layer_pattern import HybridLayerPattern
from .model import HybridModel

HybridWeights = Callable[
    [dict[str, torch.Tensor], TransformerConfig, HybridLayerPattern], dict[str, torch.Tensor]
]


def export_hybrid(
    model: HybridModel, directory: str | Path, hf_config: dict[str, Any], to_weights: HybridWeights
) -> None:
    """Write ``model`` to ``directory`` as ``hf_config`` (already checked: raise before calling)
    with the tensors ``to_weights(full state, config, pattern)`` names. Collective over the
    model's TP group and expert groups; the special token ids go into both config files, the
    tensors keep ``config.params_dtype``."""
    state, groups = gather_export_state(model)
    weights = to_weights(state, model.config, model.pattern)
    if all(dist.get_rank(g) == 0 for g in groups):
        special_tokens = special_tokens_to_hf(model)
        hf_config = hf_config | {"dtype": str(model.config.params_dtype).removeprefix("torch.")}
        write_hf_checkpoint(directory, hf_config | special_tokens, weights, special_tokens)
    for group in groups:
        dist.barrier(group=group)
