"""Logit parity with Hugging Face models of every supported family, at TP=1 and TP=2.

Oracle: a random-weight ``transformers`` model of the same config (fp32, eager attention). The HF
checkpoint is imported (sharded for TP=2), run, exported back and reloaded in HF; both comparisons
use max abs error <= 1e-4. Configs include GQA, rope scaling (llama3, linear, yarn), tied
embeddings, qk-norm and layers mixing sliding-window and full attention; sequences (12 tokens) are
longer than the windows (4) so the windows matter.
"""

from __future__ import annotations

import pytest
import torch
from mcore_models.hf import export_hf_checkpoint, import_hf_checkpoint

TOLERANCE = 1e-4
VOCAB = 128
SEQ = 12

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CASES = {
    "llama-llama3-rope": (
        "LlamaConfig",
        _LLAMA_LIKE
        | {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn": (
        "LlamaConfig",
        _LLAMA_LIKE
        | {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-mixed-window-linear-rope": (
        "Qwen2Config",
        _LLAMA_LIKE
        | {
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
        },
    ),
    "qwen3-qknorm-mixed-window-tied": (
        "Qwen3Config",
        _LLAMA_LIKE
        | {
            "head_dim": 16,
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "mistral-window": ("MistralConfig", _LLAMA_LIKE | {"sliding_window": 4}),
    "gpt2": (
        "GPT2Config",
        {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    ),
}


@pytest.fixture(scope="module")
def hf_checkpoints(hf_checkpoint_cache):
    """Per case: (directory of the saved HF model, input ids, HF logits); built once per module."""
    return hf_checkpoint_cache(CASES, VOCAB, SEQ)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_import_export_logit_parity(
    case, tp, hf_checkpoints, hf_logits, run_distributed, model_parallel, tmp_path
):
    directory, ids, reference = hf_checkpoints(case)
    exported = tmp_path / "exported"

    def body():
        groups = model_parallel(tp)
        model = import_hf_checkpoint(directory, pg_collection=groups)
        model.parallel_output = False
        with torch.no_grad():
            logits = model(ids)
        export_hf_checkpoint(model, exported)
        return logits.numpy()  # tensors do not travel through the harness's pipe

    for logits in run_distributed(body, tp, timeout=60):
        error = (torch.from_numpy(logits) - reference).abs().max().item()
        print(f"{case} tp={tp}: import max abs error {error:.2e}")
        assert error <= TOLERANCE
    reload_error = (hf_logits(exported, ids) - reference).abs().max().item()
    print(f"{case} tp={tp}: export+reload max abs error {reload_error:.2e}")
    assert reload_error <= TOLERANCE


@pytest.mark.parametrize(
    "overrides",
    [{"window_size": None, "window_attn_skip_freq": None}, {"window_attn_skip_freq": None}],
    ids=["no-window", "window-on-every-layer"],
)
def test_the_window_pattern_matters(overrides, hf_checkpoints, run_distributed, model_parallel):
    """Negative control: the mixed-window Qwen2 checkpoint run with another window layout differs."""
    directory, ids, reference = hf_checkpoints("qwen2-mixed-window-linear-rope")

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(1), **overrides)
        model.parallel_output = False
        with torch.no_grad():
            return model(ids).numpy()

    (logits,) = run_distributed(body, 1)
    assert (torch.from_numpy(logits) - reference).abs().max().item() > 1e-3
