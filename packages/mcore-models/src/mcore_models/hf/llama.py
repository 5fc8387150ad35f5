"""Llama: RMSNorm, SwiGLU, RoPE (plain, linear, llama3 or YaRN), GQA; the base of the Llama-like families."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config.transformer_config import TransformerConfig
from .mapping import HFMapping, unsupported
from .qkv import pack_qkv, unpack_qkv
from .rope_config import rope_from_hf, rope_to_hf

_ACTIVATIONS = {"silu": "swiglu", "gelu": "geglu"}


class LlamaMapping(HFMapping):
    """``LlamaForCausalLM``. Subclasses switch on qkv biases, qk-norm and sliding windows."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {"bos_token_id": 1, "eos_token_id": 2}
    has_qk_norm: ClassVar[bool] = False

    # -- config --------------------------------------------------------------------------------
    def bias_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attention_bias != mlp_bias:
            raise unsupported("attention_bias/mlp_bias", (attention_bias, mlp_bias), "equal values")
        return {"add_bias_linear": bool(attention_bias), "add_qkv_bias": bool(attention_bias)}

    def bias_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.add_qkv_bias and not config.add_bias_linear:
            raise ValueError(f"{self.model_type} cannot hold a qkv-only bias")
        return {"attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear}

    def window_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {}

    def window_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.window_size is not None:
            raise ValueError(f"{self.model_type} has no sliding-window attention")
        return {}

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
        act = hf.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise unsupported("hidden_act", act, ", ".join(_ACTIVATIONS))
        heads = hf["num_attention_heads"]
        kwargs = {
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"],
            "num_attention_heads": heads,
            "num_query_groups": hf.get("num_key_value_heads") or heads,
            "ffn_hidden_size": hf["intermediate_size"],
            "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
            "normalization": "RMSNorm",
            "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
            "qk_layernorm": self.has_qk_norm,
            "activation": _ACTIVATIONS[act],
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "share_embeddings_and_output_weights": hf.get("tie_word_embeddings", False),
            "attention_dropout": hf.get("attention_dropout", 0.0),
            "hidden_dropout": 0.0,
            "init_method_std": hf.get("initializer_range", 0.02),
            **self.bias_from_hf(hf),
            **rope_from_hf(hf),
            **self.window_from_hf(hf),
        }
        return kwargs, hf["vocab_size"]

    def config_to_hf(self, config: TransformerConfig, vocab_size: int) -> dict[str, Any]:
        self.check_mlp_kind(config)
        activation = {v: k for k, v in _ACTIVATIONS.items()}.get(config.activation)
        if activation is None or config.normalization != "RMSNorm":
            raise ValueError(
                f"{self.model_type} needs RMSNorm and swiglu/geglu, got {config.normalization}/{config.activation}"
            )
        if config.position_embedding_type not in ("rope", "yarn") or config.softmax_type != "vanilla":
            raise ValueError(f"{self.model_type} needs rotary positions and the vanilla softmax")
        return {
            "vocab_size": vocab_size,
            "num_hidden_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "intermediate_size": config.ffn_hidden_size,
            "head_dim": config.kv_channels,
            "hidden_act": activation,
            "rms_norm_eps": config.layernorm_epsilon,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.share_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
            "initializer_range": config.init_method_std,
            **self.bias_to_hf(config),
            **rope_to_hf(config),
            **self.window_to_hf(config),
        }

    # -- weights -------------------------------------------------------------------------------
    def layer_names(self) -> dict[str, str]:
        """mcore layer suffix -> HF layer suffix for tensors that map one to one."""
        names = {
            "input_layernorm.weight": "input_layernorm.weight",
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
            "mlp.linear_fc2.bias": "mlp.down_proj.bias",
        }
        if self.has_qk_norm:
            names |= {
                "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            }
        return names

    def state_from_hf(
        self, weights: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        g, d = config.num_query_groups, config.kv_channels
        state = {
            "embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": weights["model.norm.weight"],
        }
        tied = config.share_embeddings_and_output_weights
        state["output_layer.weight"] = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
            for mine, hf_name in self.layer_names().items():
                if theirs + hf_name in weights:
                    state[ours + mine] = weights[theirs + hf_name]
            attn, mlp = theirs + "self_attn.", theirs + "mlp."
            for kind in ("weight", "bias"):
                if f"{attn}q_proj.{kind}" in weights:
                    state[f"{ours}self_attention.linear_qkv.{kind}"] = pack_qkv(
                        *(weights[f"{attn}{p}_proj.{kind}"] for p in "qkv"), g, d
                    )
                if f"{mlp}gate_proj.{kind}" in weights:
                    state[f"{ours}mlp.linear_fc1.{kind}"] = torch.cat(
                        (weights[f"{mlp}gate_proj.{kind}"], weights[f"{mlp}up_proj.{kind}"])
                    )
        return state

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        n, g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        weights = {
            "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
            "model.norm.weight": state["decoder.final_layernorm.weight"],
        }
        if not config.share_embeddings_and_output_weights:
            weights["lm_head.weight"] = state["output_layer.weight"]
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
            for mine, hf_name in self.layer_names().items():
                if ours + mine in state:
                    weights[theirs + hf_name] = state[ours + mine]
            for kind in ("weight", "bias"):
                fused = state.get(f"{ours}self_attention.linear_qkv.{kind}")
                if fused is not None:
                    for p, t in zip("qkv", unpack_qkv(fused, n, g, d), strict=True):
                        weights[f"{theirs}self_attn.{p}_proj.{kind}"] = t
                fc1 = state.get(f"{ours}mlp.linear_fc1.{kind}")
                if fc1 is not None:
                    gate, up = fc1.chunk(2)
                    weights[f"{theirs}mlp.gate_proj.{kind}"] = gate
                    weights[f"{theirs}mlp.up_proj.{kind}"] = up
        return weights
