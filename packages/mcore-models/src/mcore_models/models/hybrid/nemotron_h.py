"""Import a Hugging Face NemotronH checkpoint (``NemotronHForCausalLM``) into ``HybridModel``.

Layer ``i`` of Hugging Face's ``model.layers.{i}`` (``backbone.layers.{i}`` in NVIDIA's files)
becomes ``decoder.layers.{i}``: ``norm`` stays ``norm``; the Mamba mixer's tensors keep their
names under ``mixer.``; attention's ``q/k/v_proj`` become the fused ``linear_qkv``, ``o_proj``
``linear_proj``; an MLP's ``up_proj``/``down_proj`` become ``linear_fc1``/``linear_fc2``
(squared ReLU, no gate); an MoE's ``gate.weight`` / ``gate.e_score_correction_bias`` become the
router's ``weight`` / ``expert_bias``, its experts (per-expert tensors or the stacked ``experts.
up_proj``/``down_proj``) the routed experts' ``linear_fc1``/``linear_fc2`` and its
``shared_experts`` the shared expert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...hf.mapping import unsupported
from ...hf.qkv import pack_qkv
from ...ssm import MambaConfig
from .hf_import import import_hybrid
from .layer_pattern import HybridLayerPattern
from .model import HybridModel

# Hugging Face's layer type names (current and legacy) -> pattern symbols.
_SYMBOLS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
# Legacy config.json names -> the ones NemotronHConfig uses (it renames them the same way).
_LEGACY_NAMES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
# What transformers assumes when config.json omits the special token ids.
_SPECIAL_TOKEN_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# HF config key -> (the value it must have, also NemotronHConfig's default; what is supported).
_REQUIRED = {
    "mamba_hidden_act": ("silu", "silu"),
    "mlp_hidden_act": ("relu2", "relu2 (squared ReLU)"),
    "use_bias": (False, "False (no Mamba projection biases)"),
    "mlp_bias": (False, "False"),
    "use_conv_bias": (True, "True"),
    "moe_latent_size": (None, "None (no latent expert projections)"),
    "routed_scaling_factor": (1.0, "1.0"),
    "norm_topk_prob": (True, "True (the chosen sigmoid scores renormalised)"),
}


@experimental_api
def nemotron_h_pattern(hf_config: dict[str, Any]) -> HybridLayerPattern:
    """The layer pattern of a NemotronH ``config.json``: its ``layers_block_type`` list, else its
    ``hybrid_override_pattern`` string (``NotImplementedError`` when it has neither or an unknown
    layer type)."""
    types = hf_config.get("layers_block_type")
    if types is not None:
        unknown = sorted({t for t in types if t not in _SYMBOLS})
        if unknown:
            raise unsupported("layers_block_type", unknown, ", ".join(_SYMBOLS))
        return HybridLayerPattern.parse("".join(_SYMBOLS[t] for t in types))
    if "hybrid_override_pattern" in hf_config:
        return HybridLayerPattern.parse(hf_config["hybrid_override_pattern"])
    raise unsupported("layers_block_type", None, "a list of layer types or a hybrid_override_pattern")


@experimental_api
def nemotron_h_configs(
    hf_config: dict[str, Any], **overrides: Any
) -> tuple[TransformerConfig, MambaConfig, HybridLayerPattern, int]:
    """``(TransformerConfig, MambaConfig, pattern, vocab_size)`` of a NemotronH ``config.json``;
    ``overrides`` (``TransformerConfig`` fields, e.g. ``tensor_model_parallel_size``) win. Legacy
    key names (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_dt_min``, ...) are read as
    transformers reads them.

    Keys transformers' model does not use either are ignored: ``sliding_window``,
    ``time_step_limit`` (it clamps at ``time_step_min`` and has no upper limit, so
    ``mamba_dt_clamp_max`` stays unset), ``residual_in_fp32``, ``hidden_dropout``,
    ``n_shared_experts`` (always one shared expert) and the multi-token-prediction layers.

    Raises:
        NotImplementedError: an option ``HybridModel`` cannot represent (other activations,
            biases, latent MoE projections, routed scaling, unnormalised or top-1 sigmoid
            routing, group-limited routing, unknown layer types), naming the key and what is
            supported.
    """
    hf_config = _current_names(hf_config)
    for key, (allowed, help_text) in _REQUIRED.items():
        if hf_config.get(key, allowed) != allowed:
            raise unsupported(key, hf_config.get(key), help_text)
    pattern = nemotron_h_pattern(hf_config)
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kwargs: dict[str, Any] = {
        "num_layers": pattern.num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": hf_config.get("num_key_value_heads") or heads,
        "kv_channels": hf_config.get("head_dim") or hidden // heads,
        "ffn_hidden_size": hf_config["intermediate_size"],
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("layer_norm_epsilon", 1e-5),
        "activation": "squared_relu",
        "add_bias_linear": False,
        "position_embedding_type": "none",
        "max_position_embeddings": hf_config.get("max_position_embeddings", 4096),
        "share_embeddings_and_output_weights": hf_config.get("tie_word_embeddings", False),
        "attention_dropout": hf_config.get("attention_dropout", 0.0),
        "hidden_dropout": 0.0,
        "init_method_std": hf_config.get("initializer_range", 0.02),
    }
    if "E" in pattern.symbols:
        kwargs |= _moe_from_hf(hf_config)
    config = TransformerConfig(**(kwargs | overrides))
    mamba = MambaConfig(
        mamba_state_dim=hf_config.get("ssm_state_size", 128),
        mamba_head_dim=hf_config.get("mamba_head_dim", 64),
        mamba_num_groups=hf_config.get("n_groups", 8),
        mamba_num_heads=hf_config.get("mamba_num_heads", 128),
        mamba_conv_kernel=hf_config.get("conv_kernel", 4),
        mamba_chunk_size=hf_config.get("chunk_size", 128),
        mamba_dt_min=hf_config.get("time_step_min", 0.001),
        mamba_dt_max=hf_config.get("time_step_max", 0.1),
        mamba_dt_init_floor=hf_config.get("time_step_floor", 1e-4),
        mamba_dt_clamp_min=hf_config.get("time_step_min", 0.001),  # transformers clamps there
    )
    return config, mamba, pattern, hf_config["vocab_size"]


def _current_names(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {_LEGACY_NAMES.get(key, key): value for key, value in hf_config.items()}


def _moe_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    topk = hf_config.get("num_experts_per_tok", 2)
    if topk < 2:
        raise unsupported("num_experts_per_tok", topk, ">= 2 with norm_topk_prob (one expert gets weight 1)")
    groups, group_topk = hf_config.get("n_group", 1), hf_config.get("topk_group", 1)
    if group_topk != groups:
        raise unsupported(
            "n_group/topk_group", (groups, group_topk), "equal values (no group-limited routing)"
        )
    return {
        "num_moe_experts": hf_config.get("n_routed_experts", 8),
        "moe_ffn_hidden_size": hf_config.get("moe_intermediate_size", 7688),
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_load_balancing_type": "none",
        "moe_shared_expert_intermediate_size": hf_config.get("moe_shared_expert_intermediate_size", 7688),
    }


@experimental_api
def import_nemotron_h(
    source: str | Path | torch.nn.Module,
    *,
    pg_collection: ProcessGroupCollection | None = None,
    **config_overrides: Any,
) -> HybridModel:
    """A ``HybridModel`` with the weights of a NemotronH checkpoint: a directory
    (``config.json`` + ``*.safetensors``) or a ``transformers`` ``NemotronHForCausalLM``.

    Every rank keeps its tensor-parallel shard (the TP size is the groups'): attention and MLPs as
    in ``GPTModel``, each Mamba mixer's stacked ``in_proj`` ``[z; x; B; C; dt]`` and conv
    channels ``[x; B; C]`` block by block, its per-head tensors by heads; the vocabulary is padded
    as ``import_hf_checkpoint`` does; routed experts are whole on every TP rank (or split by the
    expert-parallel overrides). The Mamba time steps are clamped below at ``time_step_min``, as
    transformers does. Unsupported options raise before any weight is read. Returned in eval mode.

    Raises:
        NotImplementedError: an unsupported HF option (see ``nemotron_h_configs``), or a TP size
            above ``num_key_value_heads``.
    """
    return import_hybrid(
        source, nemotron_h_configs, nemotron_h_state, _SPECIAL_TOKEN_DEFAULTS, pg_collection, config_overrides
    )


@experimental_api
def nemotron_h_state(
    weights: dict[str, torch.Tensor], config: TransformerConfig, pattern: HybridLayerPattern
) -> dict[str, torch.Tensor]:
    """The full (TP = 1) state dict of ``HybridModel`` from NemotronH's tensors (multi-token
    prediction tensors ``mtp.*`` are dropped, as transformers does)."""
    weights = {_strip_prefix(name): t for name, t in weights.items() if not name.startswith("mtp.")}
    state = {
        "embedding.word_embeddings.weight": weights["model.embeddings.weight"],
        "decoder.final_layernorm.weight": weights["model.norm_f.weight"],
    }
    tied = config.share_embeddings_and_output_weights
    state["output_layer.weight"] = weights["model.embeddings.weight" if tied else "lm_head.weight"]
    for i, kind in enumerate(pattern.layer_types()):
        theirs, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[f"{ours}norm.weight"] = weights[f"{theirs}norm.weight"]
        theirs, ours = f"{theirs}mixer.", f"{ours}mixer."
        if kind == "mamba":
            state |= {ours + n[len(theirs) :]: t for n, t in weights.items() if n.startswith(theirs)}
        elif kind == "attention":
            q, k, v = (weights[f"{theirs}{p}_proj.weight"] for p in "qkv")
            state[f"{ours}linear_qkv.weight"] = pack_qkv(q, k, v, config.num_query_groups, config.kv_channels)
            state[f"{ours}linear_proj.weight"] = weights[f"{theirs}o_proj.weight"]
        elif kind == "mlp":
            state |= _mlp_state(weights, theirs, ours)
        else:
            state |= _moe_state(weights, theirs, ours, config.num_moe_experts)
    return state


def _strip_prefix(name: str) -> str:
    """NVIDIA's ``backbone.`` prefix as transformers' ``model.``."""
    return "model." + name[len("backbone.") :] if name.startswith("backbone.") else name


def _mlp_state(weights: dict[str, torch.Tensor], theirs: str, ours: str) -> dict[str, torch.Tensor]:
    return {
        f"{ours}linear_fc1.weight": weights[f"{theirs}up_proj.weight"],
        f"{ours}linear_fc2.weight": weights[f"{theirs}down_proj.weight"],
    }


def _moe_state(
    weights: dict[str, torch.Tensor], theirs: str, ours: str, experts: int
) -> dict[str, torch.Tensor]:
    state = {
        f"{ours}router.weight": weights[f"{theirs}gate.weight"],
        f"{ours}router.expert_bias": weights[f"{theirs}gate.e_score_correction_bias"],
        **_mlp_state(weights, f"{theirs}shared_experts.", f"{ours}shared_experts."),
    }
    if f"{theirs}experts.up_proj" in weights:  # transformers' stacked [E, f, h] / [E, h, f]
        up, down = weights[f"{theirs}experts.up_proj"], weights[f"{theirs}experts.down_proj"]
    else:
        up = torch.stack([weights[f"{theirs}experts.{e}.up_proj.weight"] for e in range(experts)])
        down = torch.stack([weights[f"{theirs}experts.{e}.down_proj.weight"] for e in range(experts)])
    for e in range(experts):
        state[f"{ours}experts.local_experts.{e}.linear_fc1.weight"] = up[e]
        state[f"{ours}experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return state
