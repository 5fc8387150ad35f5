"""Qwen3: Llama with per-head q/k RMSNorm and Qwen2-style sliding windows."""

from __future__ import annotations

from typing import Any, ClassVar

from ..config.transformer_config import TransformerConfig
from .llama import LlamaMapping
from .mapping import unsupported
from .windows import LayerTypeWindows


class Qwen3Mapping(LayerTypeWindows, LlamaMapping):
    """``Qwen3ForCausalLM``."""

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {}
    has_qk_norm: ClassVar[bool] = True

    def bias_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("attention_bias", False):  # q/k/v/o biases without MLP biases: no config for that
            raise unsupported("attention_bias", True, "False")
        return {"add_bias_linear": False, "add_qkv_bias": False}

    def bias_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.add_bias_linear or config.add_qkv_bias:
            raise ValueError(f"{self.model_type} export supports no linear biases")
        return {"attention_bias": False}
