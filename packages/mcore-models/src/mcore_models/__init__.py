"""GPT transformer models on mcore-parallel (dense or with mixture-of-experts layers from
``mcore_models.transformer.moe``), Hugging Face checkpoint import/export, datasets and tokenizers
(``mcore_models.data``), the ``mcore-train`` training loop (``mcore_models.training``), and
context parallelism (``split_batch``, ``context_parallel_attention``, ``gather_sequence``), and
``load_checkpoint_for_inference`` (a model, its config and tokenizer from a self-describing
mcore-train checkpoint or a Hugging Face directory). Norms, MLP activations and rotary embedding
run mcore-kernels' fused ops. ``mcore_models.ssm`` holds Mamba-2's functional core (the chunked
SSD scan, its decode step, the causal conv1d and the gated RMSNorm) and its mixer layer
(``MambaMixer``); ``mcore_models.models.hybrid`` the hybrid Mamba/attention/MLP/MoE models
(``HybridModel``, Hugging Face NemotronH import), for training and evaluation (serving them is
planned)."""

from importlib.metadata import version as _version

from mcore_models.checkpoints.errors import (
    CheckpointConfigMissingError,
    CheckpointFormatError,
    CheckpointSchemaError,
    TokenizerMissingError,
)
from mcore_models.checkpoints.inference_loader import InferenceCheckpoint, load_checkpoint_for_inference
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.debug.grad_logger import DataGradientLogger
from mcore_models.hf.checkpoint import export_hf_checkpoint, hf_to_transformer_config, import_hf_checkpoint
from mcore_models.hf.mapping import HFMapping
from mcore_models.hf.registry import HF_MAPPINGS
from mcore_models.hf.sharding import gather_full_tensor, shard_full_tensor, state_tensors
from mcore_models.models.gpt.embedding import LanguageModelEmbedding
from mcore_models.models.gpt.model import GPTModel
from mcore_models.transformer.attention import SelfAttention, SelfAttentionSubmodules
from mcore_models.transformer.block import TransformerBlock
from mcore_models.transformer.context_parallel import (
    context_parallel_attention,
    context_parallel_positions,
    gather_sequence,
    restore_sequence_order,
    split_batch,
    split_sequence,
)
from mcore_models.transformer.core_attention import DotProductAttention
from mcore_models.transformer.inference_context import (
    InferenceContext,
    MambaInferenceContext,
    MambaStepLayout,
)
from mcore_models.transformer.inference_model import (
    OPTIONAL_INFERENCE_MEMBERS,
    InferenceModel,
    KVCacheSpec,
    MambaInferenceStateConfig,
    mamba_state_config_of,
    missing_inference_members,
)
from mcore_models.transformer.layer import TransformerLayer, TransformerLayerSubmodules
from mcore_models.transformer.mlp import MLP, MLPSubmodules
from mcore_models.transformer.packed_seq import PackedSeqParams
from mcore_models.transformer.rope import RotaryEmbedding
from mcore_models.transformer.spec import ModuleSpec, build_module
from mcore_models.transformer.specs import get_gpt_layer_local_spec, get_gpt_layer_spec, get_gpt_layer_te_spec
from mcore_models.transformer.yarn import YarnRotaryEmbedding

__version__ = _version("mcore-models")

__all__ = [
    "HF_MAPPINGS",
    "MLP",
    "OPTIONAL_INFERENCE_MEMBERS",
    "CheckpointConfigMissingError",
    "CheckpointFormatError",
    "CheckpointSchemaError",
    "DataGradientLogger",
    "DotProductAttention",
    "GPTModel",
    "HFMapping",
    "InferenceCheckpoint",
    "InferenceContext",
    "InferenceModel",
    "KVCacheSpec",
    "LanguageModelEmbedding",
    "MLPSubmodules",
    "MambaInferenceContext",
    "MambaInferenceStateConfig",
    "MambaStepLayout",
    "ModuleSpec",
    "PackedSeqParams",
    "RotaryEmbedding",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TokenizerMissingError",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "YarnRotaryEmbedding",
    "__version__",
    "build_module",
    "context_parallel_attention",
    "context_parallel_positions",
    "export_hf_checkpoint",
    "gather_full_tensor",
    "gather_sequence",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_spec",
    "get_gpt_layer_te_spec",
    "hf_to_transformer_config",
    "import_hf_checkpoint",
    "load_checkpoint_for_inference",
    "mamba_state_config_of",
    "missing_inference_members",
    "restore_sequence_order",
    "shard_full_tensor",
    "split_batch",
    "split_sequence",
    "state_tensors",
]
