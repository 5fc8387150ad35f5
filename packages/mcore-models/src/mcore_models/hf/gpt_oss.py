"""GPT-OSS: attention with biases and a learned sink logit per head, sliding-window and full
attention layers (``layer_types``), YaRN, and in every layer top-k experts with biases behind a
router with a bias, running GPT-OSS's clamped SwiGLU.

The clamped SwiGLU is mcore's ``quick_geglu`` with ``quick_gelu_alpha = swiglu_alpha``,
``activation_clamp_value = swiglu_limit`` and ``glu_linear_offset = 1``:
``min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1)``.
HF keeps an expert's gate and up projections in alternating columns of ``gate_up_proj [E, h, 2f]``
(``[in, out]`` layout); mcore keeps ``[gate; up]`` rows of ``[2f, h]``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config.transformer_config import TransformerConfig
from .llama import LlamaMapping
from .mapping import unsupported
from .rope_config import rope_to_hf
from .windows import layer_types_of, window_from_layer_types


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2f]`` with gate and up in alternating columns -> ``[..., gate | up]``."""
    return torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1)


def _interleave(fused: torch.Tensor) -> torch.Tensor:
    """``[..., gate | up]`` -> gate and up in alternating columns."""
    gate, up = fused.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


class GptOssMapping(LlamaMapping):
    """``GptOssForCausalLM`` (unquantized checkpoints)."""

    model_type: ClassVar[str] = "gpt_oss"
    architecture: ClassVar[str] = "GptOssForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {}
    has_moe_layers: ClassVar[bool] = True

    # -- config --------------------------------------------------------------------------------
    def bias_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        # The experts always have biases; mcore's add_bias_linear gives attention the same.
        if not hf.get("attention_bias", True):
            raise unsupported("attention_bias", hf["attention_bias"], "True (experts and attention biased)")
        return {"add_bias_linear": True, "add_qkv_bias": True}

    def window_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
        if len(layer_types) != layers:
            raise unsupported("layer_types", layer_types, f"one entry per layer ({layers})")
        return window_from_layer_types(layer_types, hf.get("sliding_window"))

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", hf["quantization_config"])
            raise unsupported("quantization_config", method, "none (an unquantized checkpoint)")
        limit = hf.get("swiglu_limit", 7.0)
        if limit is None or limit < 0:
            raise unsupported("swiglu_limit", limit, "a number >= 0")
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if not experts:
            raise unsupported("num_local_experts", experts, "a positive expert count")
        # hidden_act is not read by GPT-OSS's experts: they always run the clamped SwiGLU.
        kwargs, vocab = super().config_from_hf(hf | {"hidden_act": "silu"})
        kwargs |= {
            "activation": "quick_geglu",
            "quick_gelu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "activation_clamp_value": float(limit),
            "glu_linear_offset": 1.0,
            "softmax_type": "learnable",
            "num_moe_experts": experts,
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["intermediate_size"],
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": False,  # softmax over the top-k logits
            "moe_router_linear_bias": True,
        }
        return kwargs, vocab

    def config_to_hf(self, config: TransformerConfig, vocab_size: int) -> dict[str, Any]:
        checks = {
            "num_moe_experts set (MoE layers)": config.num_moe_experts is not None,
            "activation 'quick_geglu' with glu_linear_offset 1 and an activation_clamp_value": (
                config.activation == "quick_geglu"
                and config.glu_linear_offset == 1.0
                and config.activation_clamp_value is not None
            ),
            "softmax_type 'learnable' (sink logits)": config.softmax_type == "learnable",
            "add_bias_linear": config.add_bias_linear,
            "normalization 'RMSNorm'": config.normalization == "RMSNorm",
            "position_embedding_type 'rope' or 'yarn'": config.position_embedding_type in ("rope", "yarn"),
            "softmax routing over the top-k logits with moe_router_linear_bias": (
                config.moe_router_score_function == "softmax"
                and not config.moe_router_pre_softmax
                and config.moe_router_linear_bias
            ),
            "no expert bias, group-limited routing, capacity or shared expert": (
                not config.moe_router_enable_expert_bias
                and config.moe_router_num_groups is None
                and config.moe_expert_capacity_factor is None
                and config.moe_shared_expert_intermediate_size is None
            ),
            "moe_weighted_activation off (GPT-OSS weights the output, after fc2's bias)": (
                not config.moe_weighted_activation
            ),
        }
        failed = [need for need, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"{self.model_type} export needs: {'; '.join(failed)}")
        hf = {
            "vocab_size": vocab_size,
            "num_hidden_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.kv_channels,
            "intermediate_size": config.moe_ffn_hidden_size,
            "hidden_act": "silu",
            "rms_norm_eps": config.layernorm_epsilon,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.share_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
            "initializer_range": config.init_method_std,
            "attention_bias": True,
            "num_local_experts": config.num_moe_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "swiglu_alpha": config.quick_gelu_alpha,
            "swiglu_limit": config.activation_clamp_value,
            "layer_types": layer_types_of(config),
            "sliding_window": config.window_size,
        }
        return hf | rope_to_hf(config)

    # -- weights -------------------------------------------------------------------------------
    def layer_names(self) -> dict[str, str]:
        return super().layer_names() | {
            "self_attention.core_attention.softmax_offset": "self_attn.sinks",
            "mlp.router.weight": "mlp.router.weight",
            "mlp.router.bias": "mlp.router.bias",
        }

    def state_from_hf(
        self, weights: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        state = super().state_from_hf(weights, config)
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
            fc1 = _deinterleave(weights[f"{theirs}gate_up_proj"]).transpose(1, 2)  # [E, 2f, h]
            bias1 = _deinterleave(weights[f"{theirs}gate_up_proj_bias"])  # [E, 2f]
            fc2 = weights[f"{theirs}down_proj"].transpose(1, 2)  # [E, h, f]
            bias2 = weights[f"{theirs}down_proj_bias"]  # [E, h]
            if config.moe_grouped_gemm:
                state[f"{ours}weight1"], state[f"{ours}weight2"] = fc1.contiguous(), fc2.contiguous()
                state[f"{ours}bias1"], state[f"{ours}bias2"] = bias1.unsqueeze(1), bias2.unsqueeze(1)
            else:
                for e in range(config.num_moe_experts):
                    expert = f"{ours}local_experts.{e}."
                    state[f"{expert}linear_fc1.weight"], state[f"{expert}linear_fc1.bias"] = fc1[e], bias1[e]
                    state[f"{expert}linear_fc2.weight"], state[f"{expert}linear_fc2.bias"] = fc2[e], bias2[e]
        return state

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        weights = super().state_to_hf(state, config)
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
            if config.moe_grouped_gemm:
                fc1, fc2 = state[f"{ours}weight1"], state[f"{ours}weight2"]
                bias1, bias2 = state[f"{ours}bias1"].squeeze(1), state[f"{ours}bias2"].squeeze(1)
            else:
                experts = [f"{ours}local_experts.{e}." for e in range(config.num_moe_experts)]
                fc1, bias1, fc2, bias2 = (
                    torch.stack([state[f"{expert}{name}"] for expert in experts])
                    for name in (
                        "linear_fc1.weight",
                        "linear_fc1.bias",
                        "linear_fc2.weight",
                        "linear_fc2.bias",
                    )
                )
            weights[f"{theirs}gate_up_proj"] = _interleave(fc1.transpose(1, 2)).contiguous()
            weights[f"{theirs}gate_up_proj_bias"] = _interleave(bias1).contiguous()
            weights[f"{theirs}down_proj"] = fc2.transpose(1, 2).contiguous()
            weights[f"{theirs}down_proj_bias"] = bias2.contiguous()
        return weights
