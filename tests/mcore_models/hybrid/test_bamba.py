"""``import_bamba`` / ``export_bamba`` against Hugging Face's ``BambaForCausalLM``.

Oracle: a random-weight transformers Bamba (fp32; Mamba and attention layers, each followed by a
SwiGLU MLP; grouped-query attention with half-rotary RoPE, scaled up so positions show in the
logits; random norms and ``D``; some time steps
of layer 0 below its ``time_step_limit``; a sequence ending inside a scan chunk). Imported at
TP = 1 and 2, our logits equal its logits within 1e-4; exported, the files hold the tensors
``save_pretrained`` wrote, ``config.json`` its ``time_step_limit``, ``from_pretrained`` loads them
with no missing or unexpected keys and gives the same logits, and re-importing gives the first
import's state dict. The same at TP = 1 for a finite upper limit, ``time_step_limit = (0.02,
0.5)``, with time steps above 0.5 on other heads of layer 0 (without the limit, transformers'
logits differ). Options either side cannot represent fail with errors naming them, before
anything is read or written.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.models.hybrid import HybridModel, bamba_configs, export_bamba, import_bamba
from mcore_models.ssm import MambaConfig
from safetensors.torch import load_file

TOLERANCE = 1e-4
VOCAB = 64
HF_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    attn_layer_indices=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_chunk_size=8,
    time_step_limit=(0.02, math.inf),
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)


def _hf_model(hf_config: dict) -> transformers.BambaForCausalLM:
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(transformers.BambaConfig(**hf_config)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight", ".D")):
                tensor.add_(torch.randn_like(tensor) * 0.1)
        # half the heads of layer 0 take time steps below the limit's 0.02, where it clamps them
        model.model.layers[0].mamba.dt_bias[::2] = -10.0
        model.model.layers[0].mamba.in_proj.weight *= 25.0
        # attention scores and output large enough for the positions to show in the logits
        attention = model.model.layers[1].self_attn
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
            projection.weight *= 10.0
    return model


def _saved(model, directory):
    """(``save_pretrained`` directory, input ids [2, 12], HF logits)."""
    model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return directory, ids, logits


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(``save_pretrained`` directory, input ids [2, 12], HF logits)."""
    return _saved(_hf_model(HF_CONFIG), tmp_path_factory.mktemp("bamba"))


@pytest.fixture(scope="module")
def bounded_reference(tmp_path_factory):
    """``reference`` with ``time_step_limit = (0.02, 0.5)`` and the other half of layer 0's Mamba
    heads taking time steps above 0.5; and transformers' logits of the same weights without the
    upper limit."""
    model = _hf_model(HF_CONFIG | {"time_step_limit": (0.02, 0.5)})
    with torch.no_grad():
        model.model.layers[0].mamba.dt_bias[1::2] = 2.0  # softplus(2) = 2.1 before the clamp
    saved = _saved(model, tmp_path_factory.mktemp("bamba_bounded"))
    for layer in model.model.layers:
        if hasattr(layer, "mamba"):
            layer.mamba.time_step_limit = (0.02, math.inf)
    with torch.no_grad():
        unbounded = model(saved[1]).logits
    return saved, unbounded


def _check_logits_and_round_trip(reference, tp, target, run_distributed, model_parallel):
    """Import ``reference`` at ``tp``, compare logits, export to ``target``, compare files,
    re-import and reload in transformers; returns the imported mixers' ``mamba_dt_clamp_max``."""
    source, ids, expected = reference

    def body():
        import torch.distributed as dist

        groups = model_parallel(tp)
        model = import_bamba(source, pg_collection=groups)
        types = [layer.layer_type for layer in model.decoder.layers]
        assert types == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
        assert model.config.rotary_dim == 4  # half of each head's 8 channels
        with torch.no_grad():
            local = model(ids)
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local, group=groups.tp)
        export_bamba(model, target)
        again = import_bamba(target, pg_collection=groups)
        ours, theirs = model.state_dict(), again.state_dict()
        assert ours.keys() == theirs.keys()
        changed = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        return torch.cat(shards, dim=-1), changed, model.decoder.layers[0].mixer.mamba.mamba_dt_clamp_max

    results = run_distributed(body, tp, timeout=120)
    for logits, changed, _ in results:
        assert (logits - expected).abs().max().item() <= TOLERANCE
        assert changed == []

    original, exported = load_file(source / "model.safetensors"), load_file(target / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)
    limit = json.loads((target / "config.json").read_text())["time_step_limit"]
    assert limit == json.loads((source / "config.json").read_text())["time_step_limit"]
    hf, info = transformers.BambaForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (hf.eval()(ids).logits - expected).abs().max().item() <= TOLERANCE
    return results[0][2]


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_round_trip(tp, reference, tmp_path, run_distributed, model_parallel):
    clamp_max = _check_logits_and_round_trip(
        reference, tp, tmp_path / "export", run_distributed, model_parallel
    )
    assert clamp_max is None


def test_upper_time_step_limit_logits_and_round_trip(
    bounded_reference, tmp_path, run_distributed, model_parallel
):
    reference, unbounded = bounded_reference
    assert (unbounded - reference[2]).abs().max().item() > 100 * TOLERANCE  # the upper limit matters
    clamp_max = _check_logits_and_round_trip(
        reference, 1, tmp_path / "export", run_distributed, model_parallel
    )
    assert clamp_max == 0.5
    assert json.loads((tmp_path / "export" / "config.json").read_text())["time_step_limit"] == [0.02, 0.5]


def test_half_rotary_matters(reference, run_distributed, model_parallel):
    """The same weights with every channel rotated give other logits: the test above checks the
    partial rotation, not a case where it makes no difference."""
    source, ids, expected = reference

    def body():
        model = import_bamba(source, pg_collection=model_parallel(1), rotary_percent=1.0)
        with torch.no_grad():
            return (model(ids) - expected).abs().max().item()

    assert run_distributed(body, 1, timeout=60)[0] > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mamba_proj_bias": True}, "mamba_proj_bias=True"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_type='dynamic'"),
    ],
)
def test_unsupported_options_are_named(changes, match):
    with pytest.raises(NotImplementedError, match=match):
        bamba_configs(HF_CONFIG | changes)


@pytest.mark.parametrize(
    ("limit", "clamps"), [(None, (0.0, None)), ((0.02, math.inf), (0.02, None)), ([0.0, 1.0], (0.0, 1.0))]
)
def test_time_step_limit_maps_to_the_clamps(limit, clamps):
    _, mamba, _, _ = bamba_configs(HF_CONFIG | {"time_step_limit": limit})
    assert (mamba.mamba_dt_clamp_min, mamba.mamba_dt_clamp_max) == clamps


BASE = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    position_embedding_type="rope",
    rotary_percent=0.5,
)


@pytest.mark.parametrize(
    ("pattern", "config_changes", "match"),
    [
        ("MM*-", {}, "M- or \\*- pairs"),
        ("M-*-", {"activation": "squared_relu"}, "activation='squared_relu'"),
        ("M-*-", {"rotary_percent": 1.0}, "rotary_percent=1.0"),
        ("M-*-", {"qk_layernorm": True}, "qk_layernorm=True"),
    ],
)
def test_inexpressible_models_fail_before_writing(
    pattern, config_changes, match, tmp_path, run_distributed, model_parallel
):
    target = tmp_path / "export"

    def body():
        mamba = MambaConfig(mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16)
        config = TransformerConfig(**(BASE | config_changes))
        model = HybridModel(config, VOCAB, pattern, mamba, pg_collection=model_parallel(1))
        with pytest.raises(NotImplementedError, match=match):
            export_bamba(model, target)

    run_distributed(body, 1, timeout=60)
    assert not target.exists()
