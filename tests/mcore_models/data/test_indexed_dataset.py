"""Indexed binary datasets: write, read back, slice, merge, and reject wrong files."""

import numpy as np
import pytest
from mcore_models.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetFormatError,
    IndexedDatasetWriter,
    bin_path,
    idx_path,
    merge_indexed_datasets,
    token_dtype,
)

DOCUMENTS = [[5, 1, 7], [], [2, 2, 2, 2, 9], [0]]


def _write(prefix, documents, vocab_size=10):
    with IndexedDatasetWriter(prefix, vocab_size) as writer:
        for document in documents:
            writer.add_document(document)
    return IndexedDataset(prefix)


@pytest.mark.parametrize(
    ("vocab_size", "dtype"),
    [
        (1, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (65536, np.uint16),
        (65537, np.uint32),
        (2**32 + 1, np.int64),
    ],
)
def test_dtype_is_the_smallest_that_holds_the_vocabulary(vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype


def test_round_trip_of_documents_lengths_and_pointers(tmp_path):
    dataset = _write(tmp_path / "sub" / "data", DOCUMENTS, vocab_size=300)
    assert dataset.dtype == np.uint16
    assert len(dataset) == 4 and dataset.num_documents == 4 and dataset.num_tokens == 9
    assert [dataset[i].tolist() for i in range(4)] == DOCUMENTS
    assert dataset[-1].tolist() == [0] and dataset[0].dtype == np.uint16
    assert dataset.sequence_lengths.tolist() == [3, 0, 5, 1]
    assert dataset.sequence_pointers.tolist() == [0, 6, 6, 16]  # bytes: 2 per token
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert bin_path(dataset.path_prefix).stat().st_size == 18
    assert isinstance(dataset.tokens, np.memmap)


def test_slices_of_a_sequence(tmp_path):
    dataset = _write(tmp_path / "data", DOCUMENTS)
    assert dataset.get(2, offset=1, length=3).tolist() == [2, 2, 2]
    assert dataset.get(2, offset=4).tolist() == [9]
    assert dataset.get(0, offset=3).tolist() == []
    with pytest.raises(IndexError, match=r"slice \[2, 5\) out of range for sequence 0 of length 3"):
        dataset.get(0, offset=2, length=3)
    with pytest.raises(IndexError, match="sequence index 4 out of range"):
        dataset[4]


def test_multi_sequence_documents(tmp_path):
    with IndexedDatasetWriter(tmp_path / "data", 10) as writer:
        writer.add_sequence([1, 2])
        writer.add_sequence([3])
        writer.end_document()
        writer.add_sequence([4])  # closed by finalize
    dataset = IndexedDataset(tmp_path / "data")
    assert len(dataset) == 3 and dataset.document_indices.tolist() == [0, 2, 3]


def test_out_of_vocabulary_tokens_are_rejected_and_a_failed_write_leaves_no_files(tmp_path):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\), got \[3, 10\]"):
        with IndexedDatasetWriter(tmp_path / "data", 10) as writer:
            writer.add_document([3, 10])
    assert not bin_path(tmp_path / "data").exists() and not idx_path(tmp_path / "data").exists()


def test_wrong_files_give_clear_errors(tmp_path):
    _write(tmp_path / "data", DOCUMENTS)
    with pytest.raises(FileNotFoundError, match=r"missing\.idx does not exist"):
        IndexedDataset(tmp_path / "missing")
    header = idx_path(tmp_path / "data").read_bytes()
    idx_path(tmp_path / "data").write_bytes(b"MMIDIDX\x00\x00" + header[9:])
    with pytest.raises(IndexedDatasetFormatError, match="not an mcore indexed dataset index"):
        IndexedDataset(tmp_path / "data")
    idx_path(tmp_path / "data").write_bytes(header[:8] + (2).to_bytes(4, "little") + header[12:])
    with pytest.raises(IndexedDatasetFormatError, match="format version 2; this reader reads 1"):
        IndexedDataset(tmp_path / "data")
    idx_path(tmp_path / "data").write_bytes(header)
    bin_path(tmp_path / "data").write_bytes(b"\x00" * 8)
    with pytest.raises(IndexedDatasetFormatError, match="describes 9 tokens of uint8"):
        IndexedDataset(tmp_path / "data")


def test_empty_dataset(tmp_path):
    dataset = _write(tmp_path / "data", [])
    assert len(dataset) == 0 and dataset.num_documents == 0 and dataset.num_tokens == 0


def test_merge_keeps_order_and_widens_the_dtype(tmp_path):
    narrow = _write(tmp_path / "a", DOCUMENTS, vocab_size=10)
    wide = _write(tmp_path / "b", [[300, 301], [7]], vocab_size=400)
    merged = merge_indexed_datasets(
        tmp_path / "merged", [narrow.path_prefix, wide.path_prefix, narrow.path_prefix]
    )
    assert merged.dtype == np.uint16
    assert [merged[i].tolist() for i in range(len(merged))] == [*DOCUMENTS, [300, 301], [7], *DOCUMENTS]
    assert merged.document_indices.tolist() == list(range(11))
    with IndexedDatasetWriter(tmp_path / "c", 10) as writer, pytest.raises(ValueError, match="wider"):
        writer.add_dataset(wide.path_prefix)
