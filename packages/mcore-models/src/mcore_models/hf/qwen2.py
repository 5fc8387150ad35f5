"""Qwen2: Llama with q/k/v biases and sliding windows on the layers of ``layer_types``."""

from __future__ import annotations

from typing import Any, ClassVar

from ..config.transformer_config import TransformerConfig
from .llama import LlamaMapping
from .windows import LayerTypeWindows


class Qwen2Mapping(LayerTypeWindows, LlamaMapping):
    """``Qwen2ForCausalLM``."""

    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {}

    def bias_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"add_bias_linear": False, "add_qkv_bias": True}

    def bias_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.add_bias_linear or not config.add_qkv_bias:
            raise ValueError(
                f"{self.model_type} has biases on q/k/v only (add_qkv_bias and not add_bias_linear)"
            )
        return {}
