"""Transformer, MoE and Mamba/hybrid language models built on mcore-parallel and
mcore-kernels, Hugging Face checkpoint import/export, datasets, and the training loop."""

from importlib.metadata import version as _version

from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.hf.checkpoint import export_hf_checkpoint, hf_to_transformer_config, import_hf_checkpoint
from mcore_models.models.gpt.model import GPTModel
from mcore_models.transformer.packed_seq import PackedSeqParams
from mcore_models.transformer.spec import ModuleSpec, build_module
from mcore_models.transformer.specs import get_gpt_layer_local_spec, get_gpt_layer_spec, get_gpt_layer_te_spec

__version__ = _version("mcore-models")

__all__ = [
    "GPTModel",
    "ModuleSpec",
    "PackedSeqParams",
    "TransformerConfig",
    "__version__",
    "build_module",
    "export_hf_checkpoint",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_spec",
    "get_gpt_layer_te_spec",
    "hf_to_transformer_config",
    "import_hf_checkpoint",
]
