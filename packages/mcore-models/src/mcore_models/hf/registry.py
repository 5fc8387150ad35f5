"""The HF families this package converts, by ``model_type``."""

from __future__ import annotations

from .gpt2 import GPT2Mapping
from .gpt_oss import GptOssMapping
from .llama import LlamaMapping
from .mapping import HFMapping
from .mistral import MistralMapping
from .mixtral import MixtralMapping
from .qwen2 import Qwen2Mapping
from .qwen3 import Qwen3Mapping
from .qwen_moe import Qwen2MoeMapping, Qwen3MoeMapping

HF_MAPPINGS: dict[str, type[HFMapping]] = {
    m.model_type: m
    for m in (
        LlamaMapping,
        Qwen2Mapping,
        Qwen3Mapping,
        MistralMapping,
        GPT2Mapping,
        MixtralMapping,
        Qwen2MoeMapping,
        Qwen3MoeMapping,
        GptOssMapping,
    )
}


def mapping_for(model_type: str) -> HFMapping:
    """The mapping of ``model_type``; ``NotImplementedError`` naming the supported ones otherwise."""
    if model_type not in HF_MAPPINGS:
        raise NotImplementedError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: {sorted(HF_MAPPINGS)}"
        )
    return HF_MAPPINGS[model_type]()
