"""Any HF model at any TP size that divides its query heads: vocabulary padding and KV-head
replication at import, and their removal at export.

Oracle: random-weight ``transformers`` models (fp32, eager attention) whose vocabulary (61) no TP
size > 1 divides and with a single KV head, imported at TP=1, 2 and 4. Logits over the real
vocabulary equal HF's (max abs error <= 1e-4, the parity tolerance of ``test_hf_parity``), the
per-token loss equals ``cross_entropy`` of HF's logits, and export writes back exactly the
original tensors and shapes. Llama untied and tied, Qwen2 (q/k/v biases), Qwen3 (qk-norm).
"""

from __future__ import annotations

import pytest
import torch
import transformers  # imported here so forked ranks inherit it
from mcore_models.hf import export_hf_checkpoint, hf_to_transformer_config, import_hf_checkpoint
from mcore_models.hf.io import read_hf_config, read_hf_weights
from mcore_parallel import ConfigError

TOLERANCE = 1e-4
VOCAB = 61
SEQ = 10

_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
CASES = {
    "llama-untied": ("LlamaConfig", _TINY),
    "llama-tied": ("LlamaConfig", _TINY | {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", _TINY),
    "qwen3-qknorm": ("Qwen3Config", _TINY | {"head_dim": 8}),
}


@pytest.fixture(scope="module")
def hf_checkpoints(hf_checkpoint_cache):
    """Per case: (directory of the saved HF model, input ids, HF logits); built once per module."""
    return hf_checkpoint_cache(CASES, VOCAB, SEQ)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_vocab_and_replicated_kv_heads(
    case, tp, hf_checkpoints, run_distributed, model_parallel, tmp_path
):
    directory, ids, reference = hf_checkpoints(case)
    labels = torch.roll(ids, -1, dims=1)
    exported = tmp_path / "exported"

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(tp))
        spec = model.kv_cache_spec
        with torch.no_grad():
            shard = model(ids)  # parallel_output: this rank's [b, s, padded / tp]
            loss = model(ids, labels=labels)
            model.parallel_output = False
            logits = model(ids)
        export_hf_checkpoint(model, exported)
        return {
            "logits": logits.numpy(),
            "loss": loss.numpy(),
            "shard_width": shard.shape[-1],
            "padded_vocab_size": model.padded_vocab_size,
            "num_query_groups": model.config.num_query_groups,
            "kv_heads_per_rank": spec.num_kv_heads,
        }

    expected_loss = torch.nn.functional.cross_entropy(
        reference.flatten(0, 1), labels.flatten(), reduction="none"
    ).view(labels.shape)
    padded = -(-VOCAB // tp) * tp
    for out in run_distributed(body, tp, timeout=90):
        logits = torch.from_numpy(out["logits"])
        assert logits.shape == reference.shape  # exactly the real vocabulary
        error = (logits - reference).abs().max().item()
        loss_error = (torch.from_numpy(out["loss"]) - expected_loss).abs().max().item()
        print(f"{case} tp={tp}: logits max abs error {error:.2e}, loss {loss_error:.2e}")
        assert error <= TOLERANCE
        assert loss_error <= TOLERANCE
        assert out["padded_vocab_size"] == padded and out["shard_width"] == padded // tp
        assert out["num_query_groups"] == tp and out["kv_heads_per_rank"] == 1
    assert read_hf_config(exported)["num_key_value_heads"] == 1
    assert read_hf_config(exported)["vocab_size"] == VOCAB
    original, written = read_hf_weights(directory), read_hf_weights(exported)
    assert set(written) == set(original)
    for name, tensor in original.items():
        assert written[name].shape == tensor.shape and torch.equal(written[name], tensor), name


def test_padded_logits_are_minus_inf_in_the_shards(hf_checkpoints, run_distributed, model_parallel):
    """The vocab-parallel logits of the padded ids are -inf (never sampled, no loss mass); the
    loss's gradients are finite and zero on the padded output rows, which so stay zero."""
    directory, ids, _ = hf_checkpoints("llama-untied")

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(4))
        with torch.no_grad():
            logits = model(ids)
        model(ids, labels=torch.roll(ids, -1, dims=1)).sum().backward()
        grads = [p.grad for p in model.parameters()]
        rows = model.output_layer.weight.grad[VOCAB - 16 * torch.distributed.get_rank() :]  # padded
        finite = all(torch.isfinite(g).all() for g in grads)
        return logits.numpy(), finite, rows.abs().max().item() if rows.numel() else 0.0

    results = run_distributed(body, 4, timeout=90)
    full = torch.cat([torch.from_numpy(r[0]) for r in results], dim=-1)  # [b, s, 64]
    assert full.shape[-1] == 64
    assert torch.isfinite(full[..., :VOCAB]).all()
    assert torch.isneginf(full[..., VOCAB:]).all()
    assert all(finite and padded_grad == 0.0 for _, finite, padded_grad in results)


def test_make_vocab_size_divisible_by_pads_further(hf_checkpoints, run_distributed, model_parallel):
    """Megatron's 128: 61 ids at TP=2 become 256 rows; logits still cover exactly the 61."""
    directory, ids, reference = hf_checkpoints("llama-tied")

    def body():
        model = import_hf_checkpoint(
            directory, pg_collection=model_parallel(2), make_vocab_size_divisible_by=128
        )
        model.parallel_output = False
        with torch.no_grad():
            return model.padded_vocab_size, model(ids).numpy()

    for padded, logits in run_distributed(body, 2, timeout=90):
        assert padded == 256
        assert (torch.from_numpy(logits) - reference).abs().max().item() <= TOLERANCE


def _hf_config(**changes):
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "hidden_size": 48,
    } | changes


def test_replication_sets_one_query_group_per_rank():
    config, vocab = hf_to_transformer_config(
        _hf_config(num_attention_heads=8, num_key_value_heads=2), tensor_model_parallel_size=8
    )
    assert (config.num_query_groups, vocab, config.padded_vocab_size(vocab)) == (8, VOCAB, 64)
    config, _ = hf_to_transformer_config(
        _hf_config(num_attention_heads=8, num_key_value_heads=2), tensor_model_parallel_size=2
    )
    assert config.num_query_groups == 2  # no replication when TP divides the KV heads


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "fields", "numbers"),
    [
        (4, 1, 3, ("num_attention_heads", "tensor_model_parallel_size"), ("(3)", "(4)")),
        (12, 3, 4, ("num_query_groups", "tensor_model_parallel_size"), ("(4)", "(3)")),
        (12, 6, 4, ("num_query_groups", "tensor_model_parallel_size"), ("(6)", "(4)")),
    ],
    ids=["tp-does-not-divide-heads", "tp-above-kv-not-a-multiple", "tp-below-kv-not-a-divisor"],
)
def test_tp_that_cannot_split_the_heads_is_a_config_error(heads, kv_heads, tp, fields, numbers):
    with pytest.raises(ConfigError) as error:
        hf_to_transformer_config(
            _hf_config(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 4),
            tensor_model_parallel_size=tp,
        )
    assert error.value.fields == fields
    assert all(n in str(error.value) for n in numbers), str(error.value)


def test_export_refuses_kv_copies_that_drifted_apart(
    hf_checkpoints, run_distributed, model_parallel, tmp_path
):
    """After an update that moves the copies apart, merging them back is an error; keeping every
    head (``num_key_value_heads=tp``) still exports a model HF computes the same logits with."""
    directory, ids, _ = hf_checkpoints("qwen2")
    first, second = tmp_path / "merged", tmp_path / "kept"

    def body():
        model = import_hf_checkpoint(directory, pg_collection=model_parallel(2))
        with torch.no_grad():
            model.decoder.layers[0].self_attention.linear_qkv.bias.add_(
                0.01 * (1 + torch.distributed.get_rank())
            )
        try:
            export_hf_checkpoint(model, first)
            raised = None
        except ValueError as error:
            raised = str(error)
        export_hf_checkpoint(model, second, num_key_value_heads=2)
        model.parallel_output = False
        with torch.no_grad():
            return raised, model(ids).numpy()

    (raised, logits), _ = run_distributed(body, 2, timeout=90)
    assert raised is not None and "copies of each key/value head differ" in raised
    assert not first.exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(second, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (hf(ids).logits - torch.from_numpy(logits)).abs().max().item() <= TOLERANCE
    assert read_hf_config(second)["num_key_value_heads"] == 2
