"""Mistral: Llama with one sliding window on every layer."""

from __future__ import annotations

from typing import Any, ClassVar

from ..config.transformer_config import TransformerConfig
from .llama import LlamaMapping
from .windows import window_from_layer_types


class MistralMapping(LlamaMapping):
    """``MistralForCausalLM``."""

    model_type: ClassVar[str] = "mistral"
    architecture: ClassVar[str] = "MistralForCausalLM"

    def bias_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"add_bias_linear": False, "add_qkv_bias": False}

    def bias_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.add_bias_linear or config.add_qkv_bias:
            raise ValueError(f"{self.model_type} has no linear biases")
        return {}

    def window_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        window = hf.get("sliding_window")
        return window_from_layer_types(
            ["sliding_attention"] * hf["num_hidden_layers"] if window else None, window
        )

    def window_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.window_size is not None and config.window_attn_skip_freq is not None:
            raise ValueError(
                f"{self.model_type} applies its window to every layer; mixed patterns need qwen2/qwen3"
            )
        return {"sliding_window": config.window_size}
