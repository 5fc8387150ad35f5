"""Layer specs: the local (pure PyTorch) one, the Transformer Engine one, and the choice by config."""

from __future__ import annotations

from mcore_parallel import ColumnParallelLinear, RowParallelLinear

from ..config.transformer_config import TransformerConfig
from .attention import SelfAttention, SelfAttentionSubmodules
from .core_attention import DotProductAttention
from .layer import TransformerLayer, TransformerLayerSubmodules
from .mlp import MLP, MLPSubmodules
from .moe import GroupedExperts, MoELayer, MoESubmodules, SequentialExperts, SharedExpertMLP
from .norm import build_norm
from .spec import ModuleSpec


def get_moe_spec(*, grouped_gemm: bool = False, shared_expert: bool = False) -> ModuleSpec:
    """An ``MoELayer`` with the top-k router, sequential or grouped experts and optionally a shared expert."""
    shared = None
    if shared_expert:
        shared = ModuleSpec(
            module=SharedExpertMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=GroupedExperts if grouped_gemm else SequentialExperts, shared_experts=shared
        ),
    )


def get_gpt_layer_local_spec(
    qk_layernorm: bool = False,
    *,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    moe_shared_expert: bool = False,
) -> ModuleSpec:
    """A GPT layer from mcore-parallel's TP linears, ``torch.nn`` norms and plain-PyTorch attention.

    With ``num_experts`` the MLP is an ``MoELayer`` (see ``get_moe_spec``).
    """
    mlp = ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    if num_experts is not None:
        mlp = get_moe_spec(grouped_gemm=moe_grouped_gemm, shared_expert=moe_shared_expert)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=build_norm if qk_layernorm else None,
                    k_layernorm=build_norm if qk_layernorm else None,
                ),
            ),
            pre_mlp_layernorm=build_norm,
            mlp=mlp,
        ),
    )


def get_gpt_layer_te_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """The local spec with Transformer Engine linears and norms (attention stays plain PyTorch).

    Imports Transformer Engine now; raises ``ImportError`` with the install hint when it is missing.
    """
    from . import te_layers  # imports transformer_engine

    spec = get_gpt_layer_local_spec(qk_layernorm)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = te_layers.te_norm
    attention = layer.self_attention.submodules
    attention.linear_qkv = layer.mlp.submodules.linear_fc1 = te_layers.TEColumnParallelLinear
    attention.linear_proj = layer.mlp.submodules.linear_fc2 = te_layers.TERowParallelLinear
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = te_layers.te_norm
    return spec


def get_gpt_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """The spec ``config.transformer_impl`` asks for, with qk-norm as configured."""
    if config.transformer_impl == "transformer_engine":
        return get_gpt_layer_te_spec(config.qk_layernorm)
    return get_gpt_layer_local_spec(
        config.qk_layernorm,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_shared_expert=config.moe_shared_expert_intermediate_size is not None,
    )
