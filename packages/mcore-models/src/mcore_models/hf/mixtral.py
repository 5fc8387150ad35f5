"""Mixtral: Mistral with top-k softmax-routed SwiGLU experts in every layer."""

from __future__ import annotations

from typing import ClassVar

from .mistral import MistralMapping
from .moe import MoEMapping


class MixtralMapping(MoEMapping, MistralMapping):
    """``MixtralForCausalLM``."""

    model_type: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    block: ClassVar[str] = "block_sparse_moe."
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")
    experts_key: ClassVar[str] = "num_local_experts"
