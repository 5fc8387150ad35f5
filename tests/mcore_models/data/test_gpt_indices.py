"""Document, sample and shuffle indices against hand-computed values and a naive oracle."""

import numpy as np
import pytest
from mcore_models.data import gpt_indices
from mcore_models.data.gpt_indices import (
    build_document_index,
    build_gpt_indices,
    build_sample_index,
    cached_gpt_indices,
    num_epochs_needed,
)

LENGTHS = np.array([3, 0, 4, 2])
READ_ORDER = np.array([2, 0, 1, 3])  # read lengths 4, 3, 0, 2: document ends at 4, 7, 7, 9


def test_epochs_cover_num_samples_times_seq_length_plus_one():
    assert num_epochs_needed(tokens_per_epoch=9, seq_length=2, num_samples=4) == 1  # 9 tokens
    assert num_epochs_needed(tokens_per_epoch=9, seq_length=2, num_samples=5) == 2  # 11 tokens
    assert num_epochs_needed(tokens_per_epoch=9, seq_length=4, num_samples=2) == 1
    with pytest.raises(ValueError, match="no tokens"):
        num_epochs_needed(0, 2, 1)


def test_document_index_is_one_permutation_per_epoch():
    index = build_document_index(5, 3, np.random.default_rng(0))
    assert index.dtype == np.int64 and len(index) == 15
    for epoch in index.reshape(3, 5):
        assert sorted(epoch) == [0, 1, 2, 3, 4]


def test_sample_index_by_hand():
    assert build_sample_index(LENGTHS, READ_ORDER, seq_length=2, num_samples=4).tolist() == [
        [0, 0],
        [0, 2],
        [1, 0],  # token 4 is the first of the second document read
        [1, 2],
    ]
    starts = build_sample_index(LENGTHS, READ_ORDER, seq_length=1, num_samples=8)
    assert starts[7].tolist() == [3, 0]  # token 7 ends documents 1 and 2 (empty): start of 3
    with pytest.raises(ValueError, match="3 samples of 3 \\+ 1 tokens need more than 9 tokens"):
        build_sample_index(LENGTHS, READ_ORDER, seq_length=3, num_samples=3)


@pytest.mark.parametrize(("seq_length", "num_samples"), [(1, 30), (5, 40), (13, 7), (50, 9)])
def test_samples_are_consecutive_windows_of_the_document_stream(seq_length, num_samples):
    rng = np.random.default_rng(seq_length)
    lengths = rng.integers(0, 12, size=17)
    documents = [np.arange(length) + 100 * i for i, length in enumerate(lengths)]
    indices = build_gpt_indices(lengths, seq_length, num_samples, seed=3)
    stream = np.concatenate([documents[d] for d in indices.document_index])
    for sample, (position, offset) in enumerate(indices.sample_index):
        start = sample * seq_length
        document = indices.document_index[position]
        assert stream[start] == documents[document][offset]
    assert len(stream) >= num_samples * seq_length + 1
    assert len(stream) - sum(lengths) < num_samples * seq_length + 1  # no epoch more than needed
    assert sorted(indices.shuffle_index) == list(range(num_samples))


def test_same_seed_same_indices_other_seed_other_indices():
    first, again, other = (build_gpt_indices(LENGTHS, 2, 20, seed) for seed in (1, 1, 2))
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.shuffle_index, other.shuffle_index)


def test_indices_are_cached_and_reused(tmp_path, monkeypatch):
    built = cached_gpt_indices(LENGTHS, 2, 20, 1, tmp_path, "data-gpt")
    assert len(list(tmp_path.glob("data-gpt-*-*_index.npy"))) == 3

    def refuse(*args):
        raise AssertionError("cached indices should have been loaded")

    monkeypatch.setattr(gpt_indices, "build_gpt_indices", refuse)
    loaded = cached_gpt_indices(LENGTHS, 2, 20, 1, tmp_path, "data-gpt")
    assert isinstance(loaded.sample_index, np.memmap)
    assert np.array_equal(loaded.sample_index, built.sample_index)
    with pytest.raises(AssertionError, match="cached indices"):
        cached_gpt_indices(LENGTHS, 2, 20, 2, tmp_path, "data-gpt")  # another seed: another key
