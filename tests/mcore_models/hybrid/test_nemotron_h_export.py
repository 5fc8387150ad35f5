"""``export_nemotron_h`` against Hugging Face's ``NemotronHForCausalLM``.

Oracle: a random-weight transformers NemotronH (fp32; Mamba, attention, MLP and MoE layers; an
odd vocabulary, so TP = 2 pads it; random expert biases and norms; non-default special tokens)
saved with ``save_pretrained``. Imported at TP = 1 and 2 and exported, the files hold the same
tensor names and values ``save_pretrained`` wrote, ``from_pretrained`` loads them with no missing
or unexpected keys, its logits equal the original's within 1e-5, and re-importing the export gives
a state dict equal to the first import's. A model NemotronH cannot express fails on every rank
before any file is written.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.models.hybrid import HybridModel, export_nemotron_h, import_nemotron_h
from mcore_models.ssm import MambaConfig
from mcore_testing.nemotron_h import TINY_NEMOTRON_H
from safetensors.torch import load_file

TOLERANCE = 1e-5
VOCAB = 61
HF_CONFIG = TINY_NEMOTRON_H | dict(
    vocab_size=VOCAB,
    layers_block_type=["mamba", "attention", "mlp", "moe", "mamba"],
    bos_token_id=3,
    eos_token_id=[4, 5],
    pad_token_id=6,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(``save_pretrained`` directory, input ids [2, 10], HF logits)."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("e_score_correction_bias", "norm.weight", "norm_f.weight", ".D")):
                tensor.add_(torch.randn_like(tensor) * 0.1)
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return directory, ids, logits


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip(tp, reference, tmp_path, run_distributed, model_parallel):
    source, ids, expected = reference
    target = tmp_path / "export"

    def body():
        groups = model_parallel(tp)
        model = import_nemotron_h(source, pg_collection=groups)
        export_nemotron_h(model, target)
        again = import_nemotron_h(target, pg_collection=groups)
        ours, theirs = model.state_dict(), again.state_dict()
        assert ours.keys() == theirs.keys()
        return [name for name in ours if not torch.equal(ours[name], theirs[name])]

    assert run_distributed(body, tp, timeout=120) == [[]] * tp

    original, exported = load_file(source / "model.safetensors"), load_file(target / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)
    config = json.loads((target / "config.json").read_text())
    assert config["layers_block_type"] == [
        "linear_attention",
        "full_attention",
        "mlp",
        "moe",
        "linear_attention",
    ]
    assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (VOCAB, [4, 5], 6)
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (hf.eval()(ids).logits - expected).abs().max().item() <= TOLERANCE


# A model NemotronH can express, and changes to it that it cannot.
EXPRESSIBLE_CONFIG = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    normalization="RMSNorm",
    activation="squared_relu",
    add_bias_linear=False,
    position_embedding_type="none",
    num_moe_experts=4,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="none",
    moe_shared_expert_intermediate_size=24,
)
EXPRESSIBLE_MAMBA = dict(
    mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16, mamba_dt_clamp_min=0.01
)
CANNOT_EXPRESS = [
    ({"activation": "swiglu"}, {}, "activation='swiglu'"),
    ({"add_bias_linear": True}, {}, "add_bias_linear=True"),
    ({}, {"mamba_dt_clamp_min": 0.0}, "mamba_dt_clamp_min=0.0"),
    ({}, {"mamba_dt_clamp_max": 0.5}, "mamba_dt_clamp_max=0.5.*no upper limit"),
    ({"moe_shared_expert_intermediate_size": None}, {}, "moe_shared_expert_intermediate_size"),
    ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False}, {}, "score_function"),
]


@pytest.mark.parametrize(("config_changes", "mamba_changes", "match"), CANNOT_EXPRESS)
def test_inexpressible_models_fail_before_writing(
    config_changes, mamba_changes, match, tmp_path, run_distributed, model_parallel
):
    target = tmp_path / "export"

    def body():
        groups = model_parallel(1)
        config = TransformerConfig(**(EXPRESSIBLE_CONFIG | config_changes))
        mamba = MambaConfig(**(EXPRESSIBLE_MAMBA | mamba_changes))
        model = HybridModel(config, VOCAB, "M*-E", mamba, pg_collection=groups)
        with pytest.raises(NotImplementedError, match=match):
            export_nemotron_h(model, target)

    run_distributed(body, 1, timeout=60)
    assert not target.exists()


def test_model_built_here_exports(tmp_path, run_distributed, model_parallel):
    """A ``HybridModel`` not imported from Hugging Face (the baseline of ``CANNOT_EXPRESS``)."""
    target = tmp_path / "export"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))

    def body():
        groups = model_parallel(1)
        torch.manual_seed(0)
        mamba = MambaConfig(**EXPRESSIBLE_MAMBA)
        model = HybridModel(
            TransformerConfig(**EXPRESSIBLE_CONFIG), VOCAB, "M*-E", mamba, pg_collection=groups
        )
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name.endswith("expert_bias"):
                    tensor.normal_(0.0, 0.1)
        export_nemotron_h(model.eval(), target)
        with torch.no_grad():
            return model(ids)

    ours = run_distributed(body, 1, timeout=60)[0]
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (hf.eval()(ids).logits - ours).abs().max().item() <= TOLERANCE
