"""Logit parity with Hugging Face GPT-OSS: sink attention, alternating sliding-window and full
attention layers, YaRN, attention biases, a router with a bias, experts with biases running the
clamped SwiGLU. TP=1 with sequential and grouped experts, TP=2 (attention and sinks sharded,
experts replicated), experts split over expert-TP ranks (ETP = 2, also with EP = 2); import, and
export + HF reload.

Oracle: a random-weight ``transformers`` ``GptOssForCausalLM`` (fp32, eager attention) whose
expert projections, biases, router bias and sinks are redrawn large enough that the clamp, the
sinks and the router bias all matter (the negative controls below check each one does); max abs
error <= 1e-4 like the other families. Unsupported options fail before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models.hf import import_hf_checkpoint
from mcore_models.hf.gpt_oss import GptOssMapping
from mcore_models.hf.registry import mapping_for

TOLERANCE = 1e-4
VOCAB = 96
SEQ = 12

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,  # shorter than SEQ: the sliding layers see fewer keys than the full ones
    max_position_embeddings=128,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, ids, logits)`` of a saved random-weight GPT-OSS."""
    config = transformers.GptOssConfig(**CONFIG)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            experts, router = layer.mlp.experts, layer.mlp.router
            for param, std in (
                (experts.gate_up_proj, 1.0),  # fc1 outputs of std ~ 5.7: many beyond the limit 7
                (experts.gate_up_proj_bias, 0.5),
                (experts.down_proj_bias, 0.1),
                (router.weight, 0.5),
                (router.bias, 1.0),
                (layer.self_attn.sinks, 1.0),
                (layer.self_attn.q_proj.weight, 0.3),  # attention far from uniform: positions matter
                (layer.self_attn.k_proj.weight, 0.3),
                (layer.self_attn.v_proj.weight, 0.3),
                (layer.self_attn.o_proj.weight, 0.3),
                (layer.self_attn.q_proj.bias, 0.1),
                (layer.self_attn.o_proj.bias, 0.1),
            ):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=generator) * 0.5)
    directory = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return directory, ids, logits


def test_config_mapping(checkpoint):
    directory, _, _ = checkpoint
    hf = json.loads((directory / "config.json").read_text())
    mapping = mapping_for("gpt_oss")
    kwargs, vocab = mapping.config_from_hf(hf)
    assert vocab == VOCAB
    expected = {
        "activation": "quick_geglu",
        "quick_gelu_alpha": 1.702,
        "activation_clamp_value": 7.0,
        "glu_linear_offset": 1.0,
        "softmax_type": "learnable",
        "add_bias_linear": True,
        "window_size": 4,
        "window_attn_skip_freq": [1, 0, 1],
        "position_embedding_type": "yarn",
        "yarn_rotary_scaling_factor": 4.0,
        "yarn_original_max_position_embeddings": 32,
        "yarn_correction_range_round_to_int": False,
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 16,
        "moe_router_pre_softmax": False,
        "moe_router_linear_bias": True,
    }
    assert {k: kwargs[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("grouped", "tp"),
    [(False, 1), (True, 1), (False, 2), (True, 2)],
    ids=["sequential", "grouped", "sequential-tp2", "grouped-tp2"],
)
def test_import_export_logit_parity(grouped, tp, checkpoint, hf_logits, moe_import_logits, tmp_path):
    directory, ids, reference = checkpoint
    exported = tmp_path / "exported"

    for logits in moe_import_logits(directory, ids, tp, grouped, exported, timeout=90):
        error = (logits - reference).abs().max().item()
        print(f"gpt_oss grouped={grouped} tp={tp}: import max abs error {error:.2e}")
        assert error <= TOLERANCE
    config = json.loads((exported / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_parameters"]["rope_type"] == "yarn"
    reload_error = (hf_logits(exported, ids) - reference).abs().max().item()
    assert reload_error <= TOLERANCE


@pytest.mark.parametrize(
    ("tp", "etp", "ep", "grouped"),
    [(1, 2, 1, False), (2, 2, 1, True), (1, 2, 2, True), (2, 2, 2, False)],
    ids=["tp1-etp2", "tp2-etp2-grouped", "tp1-etp2-ep2-grouped", "tp2-etp2-ep2"],
)
def test_expert_tensor_parallel_import_export(tp, etp, ep, grouped, checkpoint, split_experts_parity):
    """Experts (and FC1's biases) split over expert-TP ranks, FC2's bias whole on each: import
    parity, export + HF reload, and the export equals the one-process export."""
    split_experts_parity(*checkpoint, TOLERANCE, tp, etp, ep, grouped)


@pytest.mark.parametrize(
    "overrides",
    [
        {"activation_clamp_value": None},
        {"glu_linear_offset": 0.0},
        {"softmax_type": "vanilla"},
        {"window_size": None, "window_attn_skip_freq": None},
        {"position_embedding_type": "rope"},
    ],
    ids=["no-clamp", "no-offset", "no-sinks", "no-window", "no-yarn"],
)
def test_each_feature_matters(overrides, checkpoint, run_distributed, model_parallel, monkeypatch):
    """Negative controls: leaving out any one GPT-OSS feature moves the logits away from HF's."""
    directory, ids, reference = checkpoint
    if overrides.get("softmax_type") == "vanilla":  # no sink parameter to load into: skip the sinks
        names = GptOssMapping.layer_names
        monkeypatch.setattr(
            GptOssMapping,
            "layer_names",
            lambda self: {k: v for k, v in names(self).items() if "softmax_offset" not in k},
        )

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(1), **overrides)
        model.parallel_output = False
        with torch.no_grad():
            return model(ids).numpy()

    (logits,) = run_distributed(body, 1)
    assert (torch.from_numpy(logits) - reference).abs().max().item() > 1e-2


def _write_config(path, **overrides):
    config = transformers.GptOssConfig(**CONFIG).to_dict() | overrides
    (path / "config.json").write_text(json.dumps(config))  # no weight files at all


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": False}, "attention_bias"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
    ids=["attention-bias", "mxfp4", "chunked", "layer-count", "dynamic-rope"],
)
def test_unsupported_options_fail_before_reading_weights(
    overrides, message, tmp_path, run_distributed, model_parallel
):
    _write_config(tmp_path, **overrides)

    def body():
        with pytest.raises(NotImplementedError, match=message):
            import_hf_checkpoint(tmp_path, pg_collection=model_parallel(1))

    run_distributed(body, 1)


def test_export_refuses_configs_gpt_oss_cannot_hold(checkpoint, run_distributed, model_parallel):
    directory, _, _ = checkpoint

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(1))
        mapping, config = mapping_for("gpt_oss"), model.config
        messages = []
        for change in (
            {"softmax_type": "vanilla"},
            {"activation": "swiglu", "activation_clamp_value": None},
            {"moe_weighted_activation": True},
            {"moe_router_linear_bias": False},
        ):
            with pytest.raises(ValueError, match="gpt_oss export needs") as error:
                mapping.config_to_hf(dataclasses.replace(config, **change), VOCAB)
            messages.append(str(error.value))
        return messages

    (messages,) = run_distributed(body, 1)
    assert "softmax_type 'learnable'" in messages[0]
    assert "moe_weighted_activation off" in messages[2]
