"""Qwen2-MoE (routed experts plus a sigmoid-gated shared expert) and Qwen3-MoE (routed experts, qk-norm)."""

from __future__ import annotations

from typing import Any, ClassVar

from .moe import MoEMapping
from .qwen2 import Qwen2Mapping
from .qwen3 import Qwen3Mapping


class Qwen2MoeMapping(MoEMapping, Qwen2Mapping):
    """``Qwen2MoeForCausalLM``."""

    model_type: ClassVar[str] = "qwen2_moe"
    architecture: ClassVar[str] = "Qwen2MoeForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {}
    has_shared_expert: ClassVar[bool] = True


class Qwen3MoeMapping(MoEMapping, Qwen3Mapping):
    """``Qwen3MoeForCausalLM``."""

    model_type: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    special_token_defaults: ClassVar[dict[str, Any]] = {}
