"""Hugging Face checkpoint import and export (Llama, Qwen2, Qwen3, Mistral, GPT-2)."""

from mcore_models.hf.checkpoint import export_hf_checkpoint, hf_to_transformer_config, import_hf_checkpoint
from mcore_models.hf.mapping import HFMapping
from mcore_models.hf.registry import HF_MAPPINGS

__all__ = [
    "HF_MAPPINGS",
    "HFMapping",
    "export_hf_checkpoint",
    "hf_to_transformer_config",
    "import_hf_checkpoint",
]
