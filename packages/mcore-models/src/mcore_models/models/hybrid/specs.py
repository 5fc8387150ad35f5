"""The layer spec of hybrid models: one ``HybridLayer`` spec whose mixer follows the pattern."""

from __future__ import annotations

from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ...ssm import MambaConfig, MambaMixer
from ...transformer.norm import build_norm
from ...transformer.spec import ModuleSpec
from ...transformer.specs import get_gpt_layer_local_spec, get_moe_spec
from .layer import HybridLayer, HybridLayerSubmodules
from .layer_pattern import HybridLayerPattern


@experimental_api
def get_hybrid_layer_spec(
    config: TransformerConfig,
    pattern: HybridLayerPattern,
    mamba: MambaConfig | None = None,
) -> ModuleSpec:
    """A ``HybridLayer`` spec for ``pattern`` from the local (pure PyTorch) parts: ``MambaMixer``
    with ``mamba``, the GPT layer's
    self-attention (qk-norm as configured) and MLP, and ``get_moe_spec`` as ``config`` asks."""
    gpt = get_gpt_layer_local_spec(config.qk_layernorm).submodules
    mamba_spec = ModuleSpec(MambaMixer, {"mamba": mamba})
    moe = None
    if config.num_moe_experts is not None:
        moe = get_moe_spec(
            grouped_gemm=config.moe_grouped_gemm,
            shared_expert=config.moe_shared_expert_intermediate_size is not None,
        )
    return ModuleSpec(
        module=HybridLayer,
        params={"pattern": pattern},
        submodules=HybridLayerSubmodules(
            norm=build_norm,
            mamba=mamba_spec,
            attention=gpt.self_attention,
            mlp=gpt.mlp,
            moe=moe,
        ),
    )
