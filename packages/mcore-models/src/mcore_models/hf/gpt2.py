"""GPT-2: learned positions, LayerNorm with bias, tanh-GELU MLP, biases everywhere, tied output.

HF GPT-2 stores its projections as ``Conv1D`` (``[in, out]``), the transpose of ``torch.nn.Linear``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config.transformer_config import TransformerConfig
from .mapping import HFMapping, unsupported
from .qkv import pack_qkv, unpack_qkv

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_LAYER_NAMES = {  # mcore suffix -> (HF suffix, stored transposed)
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    "pre_mlp_layernorm.weight": ("ln_2.weight", False),
    "pre_mlp_layernorm.bias": ("ln_2.bias", False),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
_GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
}


class GPT2Mapping(HFMapping):
    """``GPT2LMHeadModel``."""

    model_type: ClassVar[str] = "gpt2"
    architecture: ClassVar[str] = "GPT2LMHeadModel"
    special_token_defaults: ClassVar[dict[str, Any]] = {"bos_token_id": 50256, "eos_token_id": 50256}

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
        act = hf.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise unsupported("activation_function", act, ", ".join(_ACTIVATIONS))
        for flag, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if hf.get(flag, wanted) != wanted:
                raise unsupported(flag, hf[flag], str(wanted))
        if not hf.get("tie_word_embeddings", True):
            raise unsupported("tie_word_embeddings", False, "True")
        hidden = hf["n_embd"]
        kwargs = {
            "num_layers": hf["n_layer"],
            "hidden_size": hidden,
            "num_attention_heads": hf["n_head"],
            "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
            "normalization": "LayerNorm",
            "layernorm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
            "add_bias_linear": True,
            "activation": _ACTIVATIONS[act],
            "position_embedding_type": "learned_absolute",
            "max_position_embeddings": hf["n_positions"],
            "share_embeddings_and_output_weights": True,
            "attention_dropout": hf.get("attn_pdrop", 0.1),
            "hidden_dropout": hf.get("resid_pdrop", 0.1),
            "init_method_std": hf.get("initializer_range", 0.02),
        }
        return kwargs, hf["vocab_size"]

    def config_to_hf(self, config: TransformerConfig, vocab_size: int) -> dict[str, Any]:
        self.check_mlp_kind(config)
        activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}.get(config.activation)
        if (
            activation is None
            or config.normalization != "LayerNorm"
            or config.position_embedding_type != "learned_absolute"
            or not config.add_bias_linear
            or config.num_query_groups != config.num_attention_heads
            or config.kv_channels * config.num_attention_heads != config.hidden_size
            or not config.share_embeddings_and_output_weights
            or config.window_size is not None
            or config.softmax_type != "vanilla"
            or config.qk_layernorm
        ):
            raise ValueError(
                "the config is not GPT-2 shaped (LayerNorm, biases, learned positions, MHA, tied output)"
            )
        return {
            "vocab_size": vocab_size,
            "n_layer": config.num_layers,
            "n_embd": config.hidden_size,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "n_positions": config.max_position_embeddings,
            "activation_function": activation,
            "layer_norm_epsilon": config.layernorm_epsilon,
            "attn_pdrop": config.attention_dropout,
            "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout,
            "initializer_range": config.init_method_std,
            "tie_word_embeddings": True,
        }

    def state_from_hf(
        self, weights: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        n, d = config.num_attention_heads, config.kv_channels
        state = {mine: weights[theirs] for mine, theirs in _GLOBAL_NAMES.items()}
        state["output_layer.weight"] = state["embedding.word_embeddings.weight"]
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for mine, (hf_name, transposed) in _LAYER_NAMES.items():
                tensor = weights[theirs + hf_name]
                state[ours + mine] = tensor.t() if transposed else tensor
            q, k, v = weights[theirs + "attn.c_attn.weight"].t().chunk(3)
            state[ours + "self_attention.linear_qkv.weight"] = pack_qkv(q, k, v, n, d)
            q, k, v = weights[theirs + "attn.c_attn.bias"].chunk(3)
            state[ours + "self_attention.linear_qkv.bias"] = pack_qkv(q, k, v, n, d)
        return state

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        n, d = config.num_attention_heads, config.kv_channels
        weights = {theirs: state[mine] for mine, theirs in _GLOBAL_NAMES.items()}
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for mine, (hf_name, transposed) in _LAYER_NAMES.items():
                tensor = state[ours + mine]
                weights[theirs + hf_name] = tensor.t() if transposed else tensor
            fused = state[ours + "self_attention.linear_qkv.weight"]
            weights[theirs + "attn.c_attn.weight"] = torch.cat(unpack_qkv(fused, n, n, d)).t()
            weights[theirs + "attn.c_attn.bias"] = torch.cat(
                unpack_qkv(state[ours + "self_attention.linear_qkv.bias"], n, n, d)
            )
        return weights
