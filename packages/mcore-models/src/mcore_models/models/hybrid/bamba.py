"""Hugging Face Bamba (``BambaForCausalLM``) as a ``HybridModel``: import and export.

A Bamba layer is a mixer (Mamba-2 or attention) and a SwiGLU MLP, each with its own pre-norm and
residual: two ``HybridLayer``s, so Bamba's layer ``i`` becomes our layers ``2i`` (``M`` or ``*``)
and ``2i + 1`` (``-``). ``input_layernorm`` / ``pre_ff_layernorm`` become their ``norm``s; the
Mamba mixer's tensors (``mamba.*``) keep their names; ``q/k/v_proj`` become the fused
``linear_qkv``, ``o_proj`` ``linear_proj``; ``gate_proj``/``up_proj`` the gated ``linear_fc1``,
``down_proj`` ``linear_fc2``. transformers' Bamba always rotates half of each head's channels
(``rotary_percent`` 0.5) and clamps the time steps to ``time_step_limit`` (``mamba_dt_clamp_min`` /
``mamba_dt_clamp_max``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...hf.mapping import unsupported
from ...hf.qkv import pack_qkv, unpack_qkv
from ...hf.rope_config import rope_from_hf, rope_to_hf
from ...ssm import MambaConfig
from ._time_step_limit import time_step_limit_from_hf, time_step_limit_to_hf
from .hf_export import export_hybrid
from .hf_import import import_hybrid
from .layer_pattern import HybridLayerPattern
from .model import HybridModel
from .nemotron_h_export import mamba_config_of

ARCHITECTURE = "BambaForCausalLM"
# What transformers assumes when config.json omits the special token ids.
_SPECIAL_TOKEN_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# HF config key -> (the value it must have, also BambaConfig's default; what is supported).
_REQUIRED = {
    "hidden_act": ("silu", "silu (SwiGLU MLPs, SiLU in the Mamba mixers)"),
    "attention_bias": (False, "False"),
    "mlp_bias": (False, "False"),
    "mamba_proj_bias": (False, "False (no Mamba projection biases)"),
    "mamba_conv_bias": (True, "True"),
}
ROTARY_PERCENT = 0.5  # BambaConfig sets partial_rotary_factor to 0.5 whatever config.json says


@experimental_api
def bamba_pattern(hf_config: dict[str, Any]) -> HybridLayerPattern:
    """``M-`` for each Mamba layer and ``*-`` for each layer in ``attn_layer_indices``."""
    attention = set(hf_config.get("attn_layer_indices") or ())
    layers = hf_config.get("num_hidden_layers", 32)
    return HybridLayerPattern.parse("".join("*-" if i in attention else "M-" for i in range(layers)))


@experimental_api
def bamba_configs(
    hf_config: dict[str, Any], **overrides: Any
) -> tuple[TransformerConfig, MambaConfig, HybridLayerPattern, int]:
    """``(TransformerConfig, MambaConfig, pattern, vocab_size)`` of a Bamba ``config.json``;
    ``overrides`` (``TransformerConfig`` fields) win. ``z_loss_coefficient`` (a training loss
    term of transformers' Bamba) is not represented.

    Raises:
        NotImplementedError: another activation, biases, no conv bias, or a RoPE type
            ``rope_from_hf`` cannot map, naming the key and what is supported.
        ConfigError: a ``time_step_limit`` that is not ``[min, max]`` with ``0 <= min < max``.
    """
    for key, (allowed, help_text) in _REQUIRED.items():
        if hf_config.get(key, allowed) != allowed:
            raise unsupported(key, hf_config.get(key), help_text)
    low, high = time_step_limit_from_hf(hf_config.get("time_step_limit"))
    pattern = bamba_pattern(hf_config)
    hidden, heads = hf_config.get("hidden_size", 4096), hf_config.get("num_attention_heads", 32)
    kwargs: dict[str, Any] = {
        "num_layers": pattern.num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": hf_config.get("num_key_value_heads") or heads,
        "kv_channels": hf_config.get("head_dim") or hidden // heads,
        "ffn_hidden_size": hf_config.get("intermediate_size", 14336),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("rms_norm_eps", 1e-5),
        "activation": "swiglu",
        "add_bias_linear": False,
        "max_position_embeddings": hf_config.get("max_position_embeddings", 262144),
        "share_embeddings_and_output_weights": hf_config.get("tie_word_embeddings", False),
        "attention_dropout": hf_config.get("attention_dropout", 0.0),
        "hidden_dropout": 0.0,
        "init_method_std": hf_config.get("initializer_range", 0.02),
        **rope_from_hf(hf_config, partial_rotary=True),
        "rotary_percent": ROTARY_PERCENT,
    }
    mamba_heads = hf_config.get("mamba_n_heads", 128)
    head_dim = hf_config.get("mamba_d_head", "auto")
    expand = hf_config.get("mamba_expand", 2)
    mamba = MambaConfig(
        mamba_state_dim=hf_config.get("mamba_d_state", 256),
        mamba_head_dim=expand * hidden // mamba_heads if head_dim == "auto" else head_dim,
        mamba_num_groups=hf_config.get("mamba_n_groups", 1),
        mamba_num_heads=mamba_heads,
        mamba_expand=expand,
        mamba_conv_kernel=hf_config.get("mamba_d_conv", 4),
        mamba_chunk_size=hf_config.get("mamba_chunk_size", 256),
        mamba_dt_clamp_min=low,
        mamba_dt_clamp_max=high,
    )
    config = TransformerConfig(**(kwargs | overrides))
    return config, mamba, pattern, hf_config.get("vocab_size", 128000)


@experimental_api
def bamba_state(
    weights: dict[str, torch.Tensor], config: TransformerConfig, pattern: HybridLayerPattern
) -> dict[str, torch.Tensor]:
    """The full (TP = 1) state dict of ``HybridModel`` from Bamba's tensors."""
    state = {
        "embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": weights["model.final_layernorm.weight"],
    }
    tied = config.share_embeddings_and_output_weights
    state["output_layer.weight"] = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    kinds = pattern.layer_types()
    for i in range(len(kinds) // 2):
        theirs, mixer, mlp = f"model.layers.{i}.", f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        state[f"{mixer}norm.weight"] = weights[f"{theirs}input_layernorm.weight"]
        state[f"{mlp}norm.weight"] = weights[f"{theirs}pre_ff_layernorm.weight"]
        if kinds[2 * i] == "mamba":
            prefix = f"{theirs}mamba."
            state |= {
                f"{mixer}mixer.{n[len(prefix) :]}": t for n, t in weights.items() if n.startswith(prefix)
            }
        else:
            q, k, v = (weights[f"{theirs}self_attn.{p}_proj.weight"] for p in "qkv")
            state[f"{mixer}mixer.linear_qkv.weight"] = pack_qkv(
                q, k, v, config.num_query_groups, config.kv_channels
            )
            state[f"{mixer}mixer.linear_proj.weight"] = weights[f"{theirs}self_attn.o_proj.weight"]
        gate, up = (weights[f"{theirs}feed_forward.{p}_proj.weight"] for p in ("gate", "up"))
        state[f"{mlp}mixer.linear_fc1.weight"] = torch.cat((gate, up))
        state[f"{mlp}mixer.linear_fc2.weight"] = weights[f"{theirs}feed_forward.down_proj.weight"]
    return state


@experimental_api
def import_bamba(
    source: str | Path | torch.nn.Module,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    **config_overrides: Any,
) -> HybridModel:
    """A ``HybridModel`` (pattern ``M-`` / ``*-`` per Bamba layer) with the weights of a Bamba
    checkpoint: a directory (``config.json`` + ``*.safetensors``) or a ``transformers``
    ``BambaForCausalLM``. Each rank keeps its tensor-parallel shard, as ``import_nemotron_h``.
    Unsupported options raise before any weight is read. Returned in eval mode.

    Raises:
        NotImplementedError: an unsupported HF option (see ``bamba_configs``), or a TP size
            above ``num_key_value_heads``.
    """
    return import_hybrid(
        source, bamba_configs, bamba_state, _SPECIAL_TOKEN_DEFAULTS, pg_collection, config_overrides
    )


# TransformerConfig fields Bamba fixes: field -> the value it needs.
_FIXED = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "position_embedding_type": "rope",
    "rotary_percent": ROTARY_PERCENT,
    "window_size": None,
    "softmax_type": "vanilla",
    "num_moe_experts": None,
}


@experimental_api
def bamba_hf_config(model: HybridModel) -> dict[str, Any]:
    """The Bamba ``config.json`` contents of ``model`` (special tokens and ``dtype`` aside).

    Raises:
        NotImplementedError: a pattern that is not ``M-`` / ``*-`` pairs, or what Bamba fixes
            otherwise (RMSNorm, SwiGLU, no biases, no qk-norm, half-rotary RoPE, no window, the
            vanilla softmax at ``kv_channels ** -0.5``, no MoE, one ``MambaConfig``), or pipeline
            stages, naming the field and what it needs.
    """
    config, symbols = model.config, model.pattern.symbols
    if len(symbols) % 2 or any(
        symbols[i] not in "M*" or symbols[i + 1] != "-" for i in range(0, len(symbols), 2)
    ):
        raise NotImplementedError(f"Bamba layers are M- or *- pairs; the pattern is {symbols!r}")
    if not (model.pre_process and model.post_process) or config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("export a Bamba checkpoint from a model without pipeline stages")
    for field, needed in _FIXED.items():
        if getattr(config, field) != needed:
            raise NotImplementedError(
                f"Bamba cannot express {field}={getattr(config, field)!r}; it needs {needed!r}"
            )
    if config.softmax_scale not in (None, config.kv_channels**-0.5):
        raise NotImplementedError(f"Bamba cannot express softmax_scale={config.softmax_scale!r}")
    hf: dict[str, Any] = {
        "model_type": "bamba",
        "architectures": [ARCHITECTURE],
        "vocab_size": model.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": len(symbols) // 2,
        "attn_layer_indices": [i // 2 for i in range(0, len(symbols), 2) if symbols[i] == "*"],
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "rms_norm_eps": config.layernorm_epsilon,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "attention_bias": False,
        "mlp_bias": False,
        **rope_to_hf(config, partial_rotary=True),
    }
    if "M" in symbols:
        mamba = mamba_config_of(model)
        hf |= {
            "mamba_n_heads": mamba.heads(config.hidden_size),
            "mamba_d_head": mamba.mamba_head_dim,
            "mamba_n_groups": mamba.mamba_num_groups,
            "mamba_d_state": mamba.mamba_state_dim,
            "mamba_d_conv": mamba.mamba_conv_kernel,
            "mamba_expand": mamba.mamba_expand,
            "mamba_chunk_size": mamba.mamba_chunk_size,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "time_step_limit": time_step_limit_to_hf(mamba),
        }
        if hf["mamba_n_heads"] * mamba.mamba_head_dim != mamba.mamba_expand * config.hidden_size:
            raise NotImplementedError("Bamba needs mamba_n_heads * mamba_d_head = mamba_expand * hidden_size")
    return hf


@experimental_api
def bamba_weights(
    state: dict[str, torch.Tensor], config: TransformerConfig, pattern: HybridLayerPattern
) -> dict[str, torch.Tensor]:
    """Bamba's tensors of a full (TP = 1) ``HybridModel`` state dict without vocabulary padding:
    the inverse of ``bamba_state``."""
    weights = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.final_layernorm.weight": state["decoder.final_layernorm.weight"],
    }
    if not config.share_embeddings_and_output_weights:
        weights["lm_head.weight"] = state["output_layer.weight"]
    kinds = pattern.layer_types()
    for i in range(len(kinds) // 2):
        theirs, mixer, mlp = f"model.layers.{i}.", f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        weights[f"{theirs}input_layernorm.weight"] = state[f"{mixer}norm.weight"]
        weights[f"{theirs}pre_ff_layernorm.weight"] = state[f"{mlp}norm.weight"]
        if kinds[2 * i] == "mamba":
            prefix = f"{mixer}mixer."
            weights |= {
                f"{theirs}mamba.{n[len(prefix) :]}": t for n, t in state.items() if n.startswith(prefix)
            }
        else:
            q, k, v = unpack_qkv(
                state[f"{mixer}mixer.linear_qkv.weight"],
                config.num_attention_heads,
                config.num_query_groups,
                config.kv_channels,
            )
            attention = f"{theirs}self_attn."
            weights |= {
                f"{attention}q_proj.weight": q,
                f"{attention}k_proj.weight": k,
                f"{attention}v_proj.weight": v,
            }
            weights[f"{attention}o_proj.weight"] = state[f"{mixer}mixer.linear_proj.weight"]
        gate, up = state[f"{mlp}mixer.linear_fc1.weight"].chunk(2)
        weights |= {
            f"{theirs}feed_forward.gate_proj.weight": gate,
            f"{theirs}feed_forward.up_proj.weight": up,
        }
        weights[f"{theirs}feed_forward.down_proj.weight"] = state[f"{mlp}mixer.linear_fc2.weight"]
    return weights


@experimental_api
def export_bamba(model: HybridModel, directory: str | Path) -> None:
    """Write ``model`` as a Bamba checkpoint ``BambaForCausalLM.from_pretrained`` loads; the
    inverse of ``import_bamba``. Collective over the model's TP group, as ``export_nemotron_h``.

    Raises:
        NotImplementedError: ``model`` has what Bamba cannot represent (see ``bamba_hf_config``);
            raised on every rank before anything is gathered or written.
    """
    export_hybrid(model, directory, bamba_hf_config(model), bamba_weights)
