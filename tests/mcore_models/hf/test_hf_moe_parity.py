"""Logit parity with Hugging Face MoE models (Mixtral, Qwen2-MoE with its gated shared expert,
Qwen3-MoE): TP=1 with sequential and grouped experts, TP=2 (attention and shared expert sharded,
routed experts replicated), experts split over expert-TP ranks (ETP = 2, also with EP = 2),
import and export + HF reload.

Oracle: a random-weight ``transformers`` model of the same config (fp32, eager attention); max
abs error <= 1e-4 like the dense families. Unsupported MoE layouts fail before weights are read.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models.hf import import_hf_checkpoint

TOLERANCE = 1e-4
VOCAB = 96
SEQ = 10

_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
)

CASES = {
    "mixtral": ("MixtralConfig", _SHAPE | {"num_local_experts": 4}),
    "qwen2-moe-shared-gate": (
        "Qwen2MoeConfig",
        _SHAPE
        | {
            "num_experts": 6,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 40,
            "norm_topk_prob": False,
        },
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        _SHAPE | {"num_experts": 8, "moe_intermediate_size": 16, "norm_topk_prob": True, "head_dim": 16},
    ),
}


@pytest.fixture(scope="module")
def hf_checkpoints(hf_checkpoint_cache):
    return hf_checkpoint_cache(CASES, VOCAB, SEQ)


@pytest.mark.parametrize(
    ("grouped", "tp"), [(False, 1), (True, 1), (False, 2)], ids=["sequential", "grouped", "sequential-tp2"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_import_export_logit_parity(
    case, grouped, tp, hf_checkpoints, hf_logits, moe_import_logits, tmp_path
):
    directory, ids, reference = hf_checkpoints(case)
    exported = tmp_path / "exported"

    for logits in moe_import_logits(directory, ids, tp, grouped, exported, timeout=60):
        error = (logits - reference).abs().max().item()
        print(f"{case} grouped={grouped} tp={tp}: import max abs error {error:.2e}")
        assert error <= TOLERANCE
    reload_error = (hf_logits(exported, ids) - reference).abs().max().item()
    assert reload_error <= TOLERANCE


# (tp, etp, ep, grouped): the expert-TP ranks are dense data-parallel ranks (TP = 1), the
# tensor-parallel ones (TP = 2) or twice as many (TP = 2, ETP = 4); on 4 ranks each expert-TP pair
# holds half the experts (EP = 2); TP = 2 with whole experts spread over EP = 2.
ETP_LAYOUTS = {
    "tp1-etp2": (1, 2, 1, False),
    "tp2-etp2-grouped": (2, 2, 1, True),
    "tp1-etp2-ep2-grouped": (1, 2, 2, True),
    "tp2-etp4": (2, 4, 1, False),
    "tp2-etp1-ep2": (2, 1, 2, False),
}


@pytest.mark.parametrize(
    ("case", "layout"),
    [("mixtral", layout) for layout in ETP_LAYOUTS]
    + [("qwen2-moe-shared-gate", "tp2-etp2-grouped"), ("qwen3-moe", "tp1-etp2")],
)
def test_expert_tensor_parallel_import_export(case, layout, hf_checkpoints, split_experts_parity):
    """Experts split over expert-TP ranks: import parity, export + HF reload, export = ETP 1 export."""
    directory, ids, reference = hf_checkpoints(case)
    split_experts_parity(directory, ids, reference, TOLERANCE, *ETP_LAYOUTS[layout])


def test_routing_matters(hf_checkpoints, run_distributed, model_parallel):
    """Negative control: Qwen2-MoE imported with the other top-k normalization differs from HF."""
    directory, ids, reference = hf_checkpoints("qwen2-moe-shared-gate")

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(1), moe_router_pre_softmax=False)
        model.parallel_output = False
        with torch.no_grad():
            return model(ids).numpy()

    (logits,) = run_distributed(body, 1)
    assert (torch.from_numpy(logits) - reference).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"decoder_sparse_step": 2}, "decoder_sparse_step"), ({"mlp_only_layers": [0]}, "mlp_only_layers")],
)
def test_unsupported_moe_layouts_fail_before_reading_weights(
    overrides, message, tmp_path, run_distributed, model_parallel
):
    config = transformers.Qwen2MoeConfig(**CASES["qwen2-moe-shared-gate"][1] | overrides).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weight files at all

    def body():
        with pytest.raises(NotImplementedError, match=message):
            import_hf_checkpoint(tmp_path, pg_collection=model_parallel(1))

    run_distributed(body, 1)
