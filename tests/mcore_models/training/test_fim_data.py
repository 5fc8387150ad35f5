"""FIM is on by default for the default (code) corpus: training batches hold FIM sentinels at the
configured rate, held-out batches never do."""

import types

import pytest
import torch
from mcore_models.data.indexed_dataset import IndexedDataset
from mcore_models.data.tokenizer import Tokenizer
from mcore_models.training import DataConfig, iteration_micro_batches, open_train_data
from mcore_models.training import batches as batches_module


@pytest.fixture
def default_corpus_is_tiny(tiny_data, monkeypatch):
    """The default pipeline replaced by the tiny corpus (its building takes ~20 s)."""
    pipeline = types.SimpleNamespace(
        train=IndexedDataset(tiny_data.data_path),
        heldout=IndexedDataset(tiny_data.heldout_data_path),
        tokenizer=Tokenizer.from_file(tiny_data.tokenizer_file),
        unigram_baseline=5.0,
    )
    monkeypatch.setattr(batches_module, "build_default_pipeline", lambda *args, **kwargs: pipeline)


def _sentinel_rates(data, dataset, samples=400):
    tokens = torch.cat([b["tokens"] for i in range(1, samples // 8 + 1) for b in
                        iteration_micro_batches(dataset, i, 8, 8, 0, 1, torch.device("cpu"))])  # fmt: skip
    prefix, suffix = data.tokenizer.fim_prefix_id, data.tokenizer.fim_suffix_id
    rearranged = (tokens == prefix).any(dim=1)
    spm = (tokens[:, :-1] == prefix) & (tokens[:, 1:] == suffix)  # SPM: <PRE><SUF> adjacent
    return rearranged.float().mean().item(), spm.any(dim=1)[rearranged].float().mean().item()


@pytest.mark.parametrize("fim_rate, fim_spm_rate", [(0.5, 0.5), (0.9, 0.2)])
def test_training_batches_hold_fim_sentinels_at_the_configured_rate(
    default_corpus_is_tiny, fim_rate, fim_spm_rate
):
    config = DataConfig(seq_length=64, fim_rate=fim_rate, fim_spm_rate=fim_spm_rate)
    assert config.fim  # the default
    data = open_train_data(config, seed=1, train_samples=400, heldout_samples=64)
    rate, spm_share = _sentinel_rates(data, data.train)
    # 400 samples: binomial standard deviation <= 0.025; a few pieces too short to cut stay plain
    assert abs(rate - fim_rate) < 0.1 and abs(spm_share - fim_spm_rate) < 0.12
    assert _sentinel_rates(data, data.heldout, 64)[0] == 0.0  # held-out stays plain next-token


def test_no_fim_and_own_data_stay_plain(default_corpus_is_tiny, tiny_data):
    for config in (DataConfig(seq_length=64, fim=False), tiny_data):
        data = open_train_data(config, seed=1, train_samples=80, heldout_samples=8)
        assert _sentinel_rates(data, data.train, 80)[0] == 0.0
