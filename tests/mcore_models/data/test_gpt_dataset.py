"""GPTDataset: samples, labels, loss mask, position ids, determinism and the pad collision."""

import warnings

import numpy as np
import pytest
import torch
from mcore_models.data.gpt_dataset import AmbiguousPadTokenWarning, GPTDataset, GPTDatasetConfig

EOD, PAD = 0, 1
DOCUMENTS = [[5, 6, 7, EOD], [8, 9, EOD], [10, 11, 12, 13, 14, EOD], [15, EOD]]


def test_samples_follow_the_shuffled_document_stream(write_indexed):
    indexed = write_indexed(DOCUMENTS)
    dataset = GPTDataset(indexed, GPTDatasetConfig(seq_length=4, num_samples=9, eod_id=EOD, seed=7))
    stream = np.concatenate([DOCUMENTS[d] for d in dataset.indices.document_index])
    assert len(dataset) == 9
    for index in range(len(dataset)):
        start = dataset.indices.shuffle_index[index] * 4
        expected = stream[start : start + 5]
        item = dataset[index]
        assert item["tokens"].tolist() == expected[:-1].tolist()
        assert item["labels"].tolist() == expected[1:].tolist()
        assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
    assert sorted(dataset.indices.shuffle_index.tolist()) == list(range(9))
    with pytest.raises(IndexError, match="sample index 9 out of range"):
        dataset[9]


def test_determinism_by_seed_and_reuse_of_cached_indices(write_indexed):
    indexed = write_indexed(DOCUMENTS)
    config = GPTDatasetConfig(seq_length=3, num_samples=12, eod_id=EOD, seed=11)
    first = [GPTDataset(indexed, config)[i]["tokens"].tolist() for i in range(12)]
    cache_files = sorted(indexed.path_prefix.parent.glob("data-gpt-*.npy"))
    assert len(cache_files) == 3
    again = [GPTDataset(indexed, config)[i]["tokens"].tolist() for i in range(12)]
    assert again == first and sorted(indexed.path_prefix.parent.glob("data-gpt-*.npy")) == cache_files
    other_seed = GPTDatasetConfig(seq_length=3, num_samples=12, eod_id=EOD, seed=12)
    assert [GPTDataset(indexed, other_seed)[i]["tokens"].tolist() for i in range(12)] != first


def test_index_cache_dir_can_be_elsewhere(write_indexed, tmp_path):
    indexed = write_indexed(DOCUMENTS)
    config = GPTDatasetConfig(seq_length=3, num_samples=2, eod_id=EOD, index_cache_dir=str(tmp_path / "idx"))
    GPTDataset(indexed, config)
    assert len(list((tmp_path / "idx").glob("data-gpt-*.npy"))) == 3


def _single_sample(write_indexed, document, **config):
    indexed = write_indexed([document])
    return GPTDataset(indexed, GPTDatasetConfig(seq_length=len(document) - 1, num_samples=1, **config))[0]


def test_loss_mask_and_position_ids_by_hand(write_indexed):
    document = [5, 6, EOD, 7, PAD, EOD, 8, 9]
    plain = _single_sample(write_indexed, document, eod_id=EOD)
    assert plain["tokens"].tolist() == [5, 6, EOD, 7, PAD, EOD, 8]
    assert plain["labels"].tolist() == [6, EOD, 7, PAD, EOD, 8, 9]
    assert plain["loss_mask"].tolist() == [1.0] * 7
    assert plain["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6]
    reset = _single_sample(
        write_indexed, document, eod_id=EOD, pad_id=PAD, eod_mask_loss=True, reset_position_ids=True
    )
    assert reset["loss_mask"].tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        0.0,
        1.0,
    ]  # input EOD at 2, 5; label PAD at 3
    assert reset["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_pad_equal_to_eod_warns_and_masks_eod_labels(write_indexed):
    document = [5, EOD, 6, 7]
    with pytest.warns(AmbiguousPadTokenWarning, match="pad_id 0 equals eod_id"):
        sample = _single_sample(write_indexed, document, eod_id=EOD, pad_id=EOD)
    assert sample["loss_mask"].tolist() == [0.0, 1.0, 1.0]


def test_allow_ambiguous_pad_tokens_silences_the_warning(write_indexed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sample = _single_sample(
            write_indexed, [5, EOD, 6, 7], eod_id=EOD, pad_id=EOD, allow_ambiguous_pad_tokens=True
        )
        _single_sample(write_indexed, [5, EOD, 6, 7], eod_id=EOD, pad_id=PAD)
    assert sample["loss_mask"].tolist() == [0.0, 1.0, 1.0]


def test_config_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="seq_length must be at least 1, got 0"):
        GPTDatasetConfig(seq_length=0, num_samples=1, eod_id=0)


def test_batches_through_a_data_loader(write_indexed):
    dataset = GPTDataset(write_indexed(DOCUMENTS), GPTDatasetConfig(seq_length=4, num_samples=6, eod_id=EOD))
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=3)))
    assert batch["tokens"].shape == (3, 4) and batch["loss_mask"].shape == (3, 4)
