"""What every Hugging Face hybrid import shares: read the checkpoint (a directory or a
``transformers`` model), build ``HybridModel`` from the family's configs, load its tensors as
each rank's tensor-parallel shard."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_parallel import ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...hf.checkpoint import pad_vocab_rows
from ...hf.expert_parallel import local_expert_state
from ...hf.io import read_hf_config, read_hf_generation_config, read_hf_weights
from ...hf.sharding import load_full_state_dict
from ...hf.special_tokens import special_tokens_from_hf
from ...ssm import MambaConfig
from ...transformer.process_groups import resolve_process_groups
from .layer_pattern import HybridLayerPattern
from .model import HybridModel
from .specs import get_hybrid_layer_spec

HybridConfigs = tuple[TransformerConfig, MambaConfig, HybridLayerPattern, int]
HybridState = Callable[
    [dict[str, torch.Tensor], TransformerConfig, HybridLayerPattern], dict[str, torch.Tensor]
]


def import_hybrid(
    source: str | Path | torch.nn.Module,
    read_configs: Callable[..., HybridConfigs],
    read_state: HybridState,
    special_token_defaults: dict[str, Any],
    pg_collection: ProcessGroupCollection | None,
    config_overrides: dict[str, Any],
) -> HybridModel:
    """``source``'s model as a ``HybridModel`` in eval mode; ``read_configs(hf_config,
    **overrides)`` maps the family's ``config.json`` (and raises on what it cannot represent,
    before any weight is read), ``read_state(weights, config, pattern)`` its tensors to the full
    (TP = 1) state dict."""
    groups = resolve_process_groups(pg_collection)
    if isinstance(source, torch.nn.Module):
        hf_config, generation_config = source.config.to_dict(), {}
    else:
        hf_config, generation_config = read_hf_config(source), read_hf_generation_config(source)
    tp = dist.get_world_size(groups.tp)
    config, mamba, pattern, vocab_size = read_configs(
        hf_config, tensor_model_parallel_size=tp, **config_overrides
    )
    if "*" in pattern.symbols and config.num_query_groups % tp:
        raise NotImplementedError(
            f"the tensor-parallel size ({tp}) must divide num_key_value_heads ({config.num_query_groups})"
        )
    spec = get_hybrid_layer_spec(config, pattern, mamba)
    special_tokens = special_tokens_from_hf(hf_config, generation_config, special_token_defaults)
    model = HybridModel(config, vocab_size, pattern, layer_spec=spec, pg_collection=groups, **special_tokens)
    if isinstance(source, torch.nn.Module):
        weights = {name: t.detach().to(torch.float32) for name, t in source.state_dict().items()}
    else:
        weights = {name: t.to(torch.float32) for name, t in read_hf_weights(source).items()}
    state = pad_vocab_rows(read_state(weights, config, pattern), model.padded_vocab_size)
    local_expert_state(model, state)
    load_full_state_dict(model, state, groups.tp)
    return model.eval()
