"""Export ``HybridModel`` as a Hugging Face NemotronH checkpoint, the inverse of ``import_nemotron_h``.

The files are laid out as ``NemotronHForCausalLM.save_pretrained`` writes them: tensors under
``backbone.`` (``lm_head.weight`` beside it unless tied), each routed expert's
``experts.{e}.up_proj``/``down_proj`` separately, ``config.json`` with ``layers_block_type``
(and the legacy ``hybrid_override_pattern``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ...hf.qkv import unpack_qkv
from ...ssm import MambaConfig, MambaMixer
from .hf_export import export_hybrid
from .layer_pattern import HybridLayerPattern
from .model import HybridModel

ARCHITECTURE = "NemotronHForCausalLM"
# Pattern symbols -> transformers' layer type names.
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# TransformerConfig fields NemotronH fixes: field -> the value it needs.
_FIXED = {
    "normalization": "RMSNorm",
    "activation": "squared_relu",
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "position_embedding_type": "none",
    "window_size": None,
    "softmax_type": "vanilla",
}
_FIXED_MOE = {
    "moe_router_score_function": "sigmoid",
    "moe_router_pre_softmax": False,
    "moe_router_num_groups": None,
    "moe_router_linear_bias": False,
    "moe_expert_capacity_factor": None,
    "moe_shared_expert_gate": False,
    "moe_weighted_activation": False,
}


def _cannot_express(field: str, value: Any, needed: str) -> NotImplementedError:
    return NotImplementedError(f"NemotronH cannot express {field}={value!r}; it needs {needed}")


@experimental_api
def nemotron_h_hf_config(model: HybridModel) -> dict[str, Any]:
    """The NemotronH ``config.json`` contents of ``model`` (special tokens and ``dtype`` aside).

    Raises:
        NotImplementedError: ``model`` has what NemotronH cannot represent, naming the field and
            what it needs: another norm, activation, biases, qk-norm, position embedding, window
            or softmax; a softmax scale other than ``kv_channels ** -0.5``; MoE layers routed
            otherwise than by sigmoid scores of at least two experts, renormalised, without
            groups, capacity or router bias, or without one ungated shared expert; Mamba time
            steps not clamped below (``mamba_dt_clamp_min`` = 0) or clamped above
            (``mamba_dt_clamp_max``: transformers' NemotronH has no upper limit); pipeline stages.
    """
    config, pattern = model.config, model.pattern
    if not (model.pre_process and model.post_process) or config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("export a NemotronH checkpoint from a model without pipeline stages")
    for field, needed in _FIXED.items():
        if getattr(config, field) != needed:
            raise _cannot_express(field, getattr(config, field), repr(needed))
    kv_channels = config.kv_channels
    if config.softmax_scale not in (None, kv_channels**-0.5):
        raise _cannot_express("softmax_scale", config.softmax_scale, "None or kv_channels ** -0.5")
    hf: dict[str, Any] = {
        "model_type": "nemotron_h",
        "architectures": [ARCHITECTURE],
        "vocab_size": model.vocab_size,
        "hidden_size": config.hidden_size,
        "layers_block_type": [_LAYER_TYPES[s] for s in pattern.symbols],
        "hybrid_override_pattern": pattern.symbols,
        "num_hidden_layers": pattern.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": kv_channels,
        "intermediate_size": config.ffn_hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "hidden_dropout": config.hidden_dropout,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "residual_in_fp32": False,
        "num_nextn_predict_layers": 0,
    }
    if "M" in pattern.symbols:
        hf |= _mamba_to_hf(mamba_config_of(model), config.hidden_size)
    if "E" in pattern.symbols:
        hf |= _moe_to_hf(config)
    return hf


def mamba_config_of(model: HybridModel) -> MambaConfig:
    """The ``MambaConfig`` of ``model``'s Mamba mixers (``NotImplementedError`` if they differ:
    Hugging Face's configs have one)."""
    configs = [m.mamba for m in model.modules() if isinstance(m, MambaMixer)]
    if any(c != configs[0] for c in configs):
        raise NotImplementedError("Hugging Face configs need every Mamba layer to have the same MambaConfig")
    return configs[0]


def _mamba_to_hf(mamba: MambaConfig, hidden_size: int) -> dict[str, Any]:
    if mamba.mamba_dt_clamp_min <= 0:
        raise _cannot_express(
            "mamba_dt_clamp_min",
            mamba.mamba_dt_clamp_min,
            "> 0 (transformers clamps the time steps below at time_step_min)",
        )
    if mamba.mamba_dt_clamp_max is not None:
        raise _cannot_express(
            "mamba_dt_clamp_max",
            mamba.mamba_dt_clamp_max,
            "None (transformers' NemotronH clamps the time steps at no upper limit)",
        )
    return {
        "ssm_state_size": mamba.mamba_state_dim,
        "mamba_num_heads": mamba.heads(hidden_size),
        "mamba_head_dim": mamba.mamba_head_dim,
        "n_groups": mamba.mamba_num_groups,
        "conv_kernel": mamba.mamba_conv_kernel,
        "expand": mamba.mamba_expand,
        "chunk_size": mamba.mamba_chunk_size,
        "time_step_min": mamba.mamba_dt_clamp_min,
        "time_step_max": mamba.mamba_dt_max,
        "time_step_floor": mamba.mamba_dt_init_floor,
        "mamba_hidden_act": "silu",
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_proj_bias": False,
    }


def _moe_to_hf(config: TransformerConfig) -> dict[str, Any]:
    for field, needed in _FIXED_MOE.items():
        if getattr(config, field) != needed:
            raise _cannot_express(field, getattr(config, field), repr(needed))
    if config.moe_router_topk < 2:
        raise _cannot_express("moe_router_topk", config.moe_router_topk, ">= 2 (renormalised top-k)")
    if config.moe_shared_expert_intermediate_size is None:
        raise _cannot_express("moe_shared_expert_intermediate_size", None, "one shared expert")
    return {
        "n_routed_experts": config.num_moe_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "moe_intermediate_size": config.moe_ffn_hidden_size or config.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "n_shared_experts": 1,
        "moe_latent_size": None,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }


@experimental_api
def nemotron_h_weights(
    state: dict[str, torch.Tensor], config: TransformerConfig, pattern: HybridLayerPattern
) -> dict[str, torch.Tensor]:
    """NemotronH's tensors, as ``save_pretrained`` names them, of a full (TP = 1, every expert)
    ``HybridModel`` state dict without vocabulary padding: the inverse of ``nemotron_h_state``
    (a model without expert bias gets zero ``e_score_correction_bias``)."""
    weights = {
        "backbone.embeddings.weight": state["embedding.word_embeddings.weight"],
        "backbone.norm_f.weight": state["decoder.final_layernorm.weight"],
    }
    if not config.share_embeddings_and_output_weights:
        weights["lm_head.weight"] = state["output_layer.weight"]
    for i, kind in enumerate(pattern.layer_types()):
        ours, theirs = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        weights[f"{theirs}norm.weight"] = state[f"{ours}norm.weight"]
        ours, theirs = f"{ours}mixer.", f"{theirs}mixer."
        if kind == "mamba":
            weights |= {theirs + n[len(ours) :]: t for n, t in state.items() if n.startswith(ours)}
        elif kind == "attention":
            q, k, v = unpack_qkv(
                state[f"{ours}linear_qkv.weight"],
                config.num_attention_heads,
                config.num_query_groups,
                config.kv_channels,
            )
            weights |= {f"{theirs}q_proj.weight": q, f"{theirs}k_proj.weight": k, f"{theirs}v_proj.weight": v}
            weights[f"{theirs}o_proj.weight"] = state[f"{ours}linear_proj.weight"]
        elif kind == "mlp":
            weights |= _mlp_weights(state, ours, theirs)
        else:
            weights |= _moe_weights(state, ours, theirs, config.num_moe_experts)
    return weights


def _mlp_weights(state: dict[str, torch.Tensor], ours: str, theirs: str) -> dict[str, torch.Tensor]:
    return {
        f"{theirs}up_proj.weight": state[f"{ours}linear_fc1.weight"],
        f"{theirs}down_proj.weight": state[f"{ours}linear_fc2.weight"],
    }


def _moe_weights(
    state: dict[str, torch.Tensor], ours: str, theirs: str, experts: int
) -> dict[str, torch.Tensor]:
    router = state[f"{ours}router.weight"]
    bias = state.get(f"{ours}router.expert_bias")
    weights = {
        f"{theirs}gate.weight": router,
        f"{theirs}gate.e_score_correction_bias": router.new_zeros(experts) if bias is None else bias,
        **_mlp_weights(state, f"{ours}shared_experts.", f"{theirs}shared_experts."),
    }
    for e in range(experts):
        if f"{ours}experts.weight1" in state:  # grouped GEMM: stacked [E, f, h] / [E, h, f]
            up, down = state[f"{ours}experts.weight1"][e], state[f"{ours}experts.weight2"][e]
        else:
            up = state[f"{ours}experts.local_experts.{e}.linear_fc1.weight"]
            down = state[f"{ours}experts.local_experts.{e}.linear_fc2.weight"]
        weights[f"{theirs}experts.{e}.up_proj.weight"] = up
        weights[f"{theirs}experts.{e}.down_proj.weight"] = down
    return weights


@experimental_api
def export_nemotron_h(model: HybridModel, directory: str | Path) -> None:
    """Write ``model`` as a NemotronH checkpoint ``NemotronHForCausalLM.from_pretrained`` loads
    (``config.json``, ``generation_config.json``, ``model.safetensors``).

    Collective over the model's TP group (and, with experts split or spread, its expert groups),
    as ``export_hf_checkpoint``: the shards are gathered and the rank that is rank 0 of each group
    writes. The vocabulary padding is dropped; the special token ids go into both config files;
    the tensors keep ``config.params_dtype``.

    Raises:
        NotImplementedError: ``model`` has what NemotronH cannot represent (see
            ``nemotron_h_hf_config``); raised on every rank before anything is gathered or written.
    """
    export_hybrid(model, directory, nemotron_h_hf_config(model), nemotron_h_weights)
