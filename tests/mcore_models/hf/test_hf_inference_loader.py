"""``load_checkpoint_for_inference`` of a Hugging Face directory: the model of
``import_hf_checkpoint`` with the directory's tokenizer, whose end-of-document and pad tokens are the
model's. Oracle: the ``transformers`` model saved there (fp32, max abs error <= 1e-4)."""

import itertools
import shutil

import pytest
import torch
from mcore_models import TokenizerMissingError, load_checkpoint_for_inference
from mcore_models.data import stdlib_documents, train_bpe_tokenizer

VOCAB = 300
CASES = {
    "llama-for-loader": (
        "LlamaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        ),
    )
}


def _load_and_run(path, ids, dtype):
    loaded = load_checkpoint_for_inference(path, dtype=dtype)
    with torch.no_grad():
        logits = loaded.model(ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
    facts = (loaded.source, loaded.model.training, next(loaded.model.parameters()).dtype)
    return logits.float().numpy(), facts, (loaded.tokenizer.eod_id, loaded.tokenizer.pad_id)


def test_hf_directory_loads_with_its_tokenizer(hf_checkpoint_cache, run_distributed, tmp_path):
    source, ids, expected = hf_checkpoint_cache(CASES, VOCAB, 10)("llama-for-loader")
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    with pytest.raises(TokenizerMissingError, match=r"no tokenizer\.json"):
        load_checkpoint_for_inference(directory)

    texts = [d.text for d in itertools.islice(stdlib_documents(), 5)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=VOCAB)
    tokenizer.save(directory / "tokenizer.json")
    ((logits, facts, special),) = run_distributed(
        _load_and_run, 1, directory, ids, torch.float32, init_process_group=False
    )
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=1e-4)
    assert facts == ("huggingface", False, torch.float32)
    assert special == (2, 3)  # the config's eos and pad ids, not the tokenizer's <|endoftext|> (0)

    # bfloat16: the same model rounded, close to the float32 logits
    ((logits, facts, _),) = run_distributed(
        _load_and_run, 1, directory, ids, torch.bfloat16, init_process_group=False
    )
    assert facts[2] == torch.bfloat16
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=0.05)
