"""Transformer building blocks: specs, attention, MLP, layers, block, position embeddings."""

from mcore_models.transformer.attention import SelfAttention, SelfAttentionSubmodules
from mcore_models.transformer.block import TransformerBlock
from mcore_models.transformer.core_attention import DotProductAttention, sink_softmax
from mcore_models.transformer.layer import TransformerLayer, TransformerLayerSubmodules
from mcore_models.transformer.mlp import MLP, MLPSubmodules
from mcore_models.transformer.packed_seq import PackedSeqParams
from mcore_models.transformer.rope import RotaryEmbedding, apply_rotary
from mcore_models.transformer.spec import ModuleSpec, build_module
from mcore_models.transformer.specs import get_gpt_layer_local_spec, get_gpt_layer_spec, get_gpt_layer_te_spec
from mcore_models.transformer.yarn import YarnRotaryEmbedding, yarn_inverse_frequencies, yarn_mscale

__all__ = [
    "MLP",
    "DotProductAttention",
    "MLPSubmodules",
    "ModuleSpec",
    "PackedSeqParams",
    "RotaryEmbedding",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "YarnRotaryEmbedding",
    "apply_rotary",
    "build_module",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_spec",
    "get_gpt_layer_te_spec",
    "sink_softmax",
    "yarn_inverse_frequencies",
    "yarn_mscale",
]
