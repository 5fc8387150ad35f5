"""Hugging Face Mamba2 (``Mamba2ForCausalLM``) as a ``HybridModel`` whose every layer is ``M``:
import and export.

A Mamba2 block is a NemotronH Mamba layer (pre-norm, mixer, residual) and its tensors have the
same names (``backbone.embeddings``, ``backbone.layers.{i}.norm`` / ``mixer.*``,
``backbone.norm_f``, ``lm_head``), so both directions reuse NemotronH's tensor mapping; what
differs is ``config.json``. Mamba2's time steps are clamped to ``time_step_limit`` (default
``(0, inf)``: not at all; ``mamba_dt_clamp_min`` / ``mamba_dt_clamp_max``), its
``time_step_min`` only sets the initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...hf.mapping import unsupported
from ...ssm import MambaConfig
from ._time_step_limit import time_step_limit_from_hf, time_step_limit_to_hf
from .hf_export import export_hybrid
from .hf_import import import_hybrid
from .layer_pattern import HybridLayerPattern
from .model import HybridModel
from .nemotron_h import nemotron_h_state
from .nemotron_h_export import mamba_config_of, nemotron_h_weights

ARCHITECTURE = "Mamba2ForCausalLM"
# What transformers assumes when config.json omits the special token ids.
_SPECIAL_TOKEN_DEFAULTS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
# HF config key -> (the value it must have, also Mamba2Config's default; what is supported).
_REQUIRED = {
    "hidden_act": ("silu", "silu"),
    "use_bias": (False, "False (no projection biases)"),
    "use_conv_bias": (True, "True"),
}
# TransformerConfig fields Mamba2 fixes: field -> the value it needs.
_FIXED = {"normalization": "RMSNorm", "position_embedding_type": "none"}


@experimental_api
def mamba2_configs(
    hf_config: dict[str, Any], **overrides: Any
) -> tuple[TransformerConfig, MambaConfig, HybridLayerPattern, int]:
    """``(TransformerConfig, MambaConfig, pattern, vocab_size)`` of a Mamba2 ``config.json``;
    ``overrides`` (``TransformerConfig`` fields) win. The pattern is ``num_hidden_layers`` ``M``s;
    the ``TransformerConfig`` carries the hidden size, norm, embeddings and parallelism (its
    attention sizes, ``n_groups`` heads of ``head_dim``, and MLP size are unused: there are no
    such layers). ``residual_in_fp32`` is not
    represented: the residual stream keeps the parameters' dtype (equal in float32).

    Raises:
        NotImplementedError: another activation, projection biases or no conv bias, naming the
            key and what is supported.
        ConfigError: a ``time_step_limit`` that is not ``[min, max]`` with ``0 <= min < max``.
    """
    for key, (allowed, help_text) in _REQUIRED.items():
        if hf_config.get(key, allowed) != allowed:
            raise unsupported(key, hf_config.get(key), help_text)
    low, high = time_step_limit_from_hf(hf_config.get("time_step_limit"))
    layers, hidden = hf_config.get("num_hidden_layers", 64), hf_config.get("hidden_size", 4096)
    kwargs: dict[str, Any] = {
        "num_layers": layers,
        "hidden_size": hidden,
        # no attention layers: sizes whose tensor-parallel rule is the mixers' (TP divides n_groups)
        "num_attention_heads": hf_config.get("n_groups", 8),
        "kv_channels": hf_config.get("head_dim", 64),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("layer_norm_epsilon", 1e-5),
        "add_bias_linear": False,
        "position_embedding_type": "none",
        "share_embeddings_and_output_weights": hf_config.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0,
        "init_method_std": hf_config.get("initializer_range", 0.1),
    }
    mamba = MambaConfig(
        mamba_state_dim=hf_config.get("state_size", 128),
        mamba_head_dim=hf_config.get("head_dim", 64),
        mamba_num_groups=hf_config.get("n_groups", 8),
        mamba_num_heads=hf_config.get("num_heads", 128),
        mamba_expand=hf_config.get("expand", 2),
        mamba_conv_kernel=hf_config.get("conv_kernel", 4),
        mamba_chunk_size=hf_config.get("chunk_size", 256),
        mamba_dt_min=hf_config.get("time_step_min", 0.001),
        mamba_dt_max=hf_config.get("time_step_max", 0.1),
        mamba_dt_init_floor=hf_config.get("time_step_floor", 1e-4),
        mamba_dt_clamp_min=low,
        mamba_dt_clamp_max=high,
    )
    config = TransformerConfig(**(kwargs | overrides))
    return config, mamba, HybridLayerPattern.parse("M" * layers), hf_config.get("vocab_size", 32768)


@experimental_api
def import_mamba2(
    source: str | Path | torch.nn.Module,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    **config_overrides: Any,
) -> HybridModel:
    """A ``HybridModel`` of ``M`` layers with the weights of a Mamba2 checkpoint: a directory
    (``config.json`` + ``*.safetensors``) or a ``transformers`` ``Mamba2ForCausalLM``.

    Each rank keeps its tensor-parallel shard of the mixers (as ``import_nemotron_h``); the
    vocabulary is padded as ``import_hf_checkpoint`` does. Unsupported options raise before any
    weight is read. Returned in eval mode.

    Raises:
        NotImplementedError: an unsupported HF option (see ``mamba2_configs``).
    """
    return import_hybrid(
        source, mamba2_configs, nemotron_h_state, _SPECIAL_TOKEN_DEFAULTS, pg_collection, config_overrides
    )


@experimental_api
def mamba2_hf_config(model: HybridModel) -> dict[str, Any]:
    """The Mamba2 ``config.json`` contents of ``model`` (special tokens and ``dtype`` aside).

    Raises:
        NotImplementedError: a layer that is not ``M``, another norm, position embeddings,
            Mamba layers with different configs, or pipeline stages.
    """
    config, pattern = model.config, model.pattern
    if set(pattern.symbols) != {"M"}:
        raise NotImplementedError(f"Mamba2 has only Mamba layers; the pattern is {pattern.symbols!r}")
    if not (model.pre_process and model.post_process) or config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("export a Mamba2 checkpoint from a model without pipeline stages")
    for field, needed in _FIXED.items():
        if getattr(config, field) != needed:
            raise NotImplementedError(
                f"Mamba2 cannot express {field}={getattr(config, field)!r}; it needs {needed!r}"
            )
    mamba = mamba_config_of(model)
    if mamba.heads(config.hidden_size) * mamba.mamba_head_dim != mamba.mamba_expand * config.hidden_size:
        raise NotImplementedError(
            "Mamba2 needs num_heads * head_dim = expand * hidden_size; set mamba_expand to match"
        )
    return {
        "model_type": "mamba2",
        "architectures": [ARCHITECTURE],
        "vocab_size": model.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": pattern.num_layers,
        "num_heads": mamba.heads(config.hidden_size),
        "head_dim": mamba.mamba_head_dim,
        "state_size": mamba.mamba_state_dim,
        "n_groups": mamba.mamba_num_groups,
        "expand": mamba.mamba_expand,
        "conv_kernel": mamba.mamba_conv_kernel,
        "chunk_size": mamba.mamba_chunk_size,
        "time_step_min": mamba.mamba_dt_min,
        "time_step_max": mamba.mamba_dt_max,
        "time_step_floor": mamba.mamba_dt_init_floor,
        "time_step_limit": time_step_limit_to_hf(mamba),
        "hidden_act": "silu",
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "residual_in_fp32": False,
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
    }


@experimental_api
def export_mamba2(model: HybridModel, directory: str | Path) -> None:
    """Write ``model`` as a Mamba2 checkpoint ``Mamba2ForCausalLM.from_pretrained`` loads
    (``config.json``, ``generation_config.json``, ``model.safetensors``); the inverse of
    ``import_mamba2``. Collective over the model's TP group, as ``export_nemotron_h``.

    Raises:
        NotImplementedError: ``model`` has what Mamba2 cannot represent (see
            ``mamba2_hf_config``); raised on every rank before anything is gathered or written.
    """
    export_hybrid(model, directory, mamba2_hf_config(model), nemotron_h_weights)
