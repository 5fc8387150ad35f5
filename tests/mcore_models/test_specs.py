"""Module specs: build_module, the local spec's parts, and the Transformer Engine spec's import guard."""

import importlib.util

import pytest
import torch
from mcore_models import (
    ModuleSpec,
    TransformerConfig,
    build_module,
    get_gpt_layer_local_spec,
    get_gpt_layer_spec,
    get_gpt_layer_te_spec,
)


def test_build_module_merges_params_and_submodules():
    spec = ModuleSpec(module=torch.nn.Linear, params={"in_features": 2, "out_features": 3, "bias": True})
    layer = build_module(spec, bias=False)
    assert layer.weight.shape == (3, 2) and layer.bias is None
    assert build_module(torch.nn.Identity) is not None and build_module(None) is None


def test_local_spec_chosen_by_config():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, qk_layernorm=True)
    spec = get_gpt_layer_spec(config)
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm is not None
    assert get_gpt_layer_local_spec().submodules.self_attention.submodules.q_layernorm is None


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is installed"
)
def test_te_spec_without_transformer_engine_says_how_to_install():
    with pytest.raises(ImportError, match=r"mcore-models\[te\]"):
        get_gpt_layer_te_spec()


@pytest.mark.gpu
def test_te_spec_layer_matches_the_local_layer(run_distributed, model_parallel):
    pytest.importorskip("transformer_engine")

    def body():
        from mcore_models import TransformerLayer

        groups = model_parallel(1)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            normalization="RMSNorm",
            activation="swiglu",
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        torch.manual_seed(0)
        local = TransformerLayer(config, get_gpt_layer_local_spec().submodules, 1, tp_group=groups.tp).cuda()
        te_layer = TransformerLayer(config, get_gpt_layer_te_spec().submodules, 1, tp_group=groups.tp).cuda()
        te_layer.load_state_dict(local.state_dict(), strict=False)
        x = torch.randn(8, 2, 64, device="cuda")
        return (te_layer(x) - local(x)).abs().max().item()

    assert run_distributed(body, 1)[0] <= 1e-3  # TE may use TF32 matmuls
