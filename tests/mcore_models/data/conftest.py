"""Helpers shared by the data tests."""

import pytest
from mcore_models.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


@pytest.fixture
def write_indexed(tmp_path):
    """``write_indexed(documents, name="data", vocab_size=100)`` writes one sequence per document
    under ``tmp_path`` and returns the opened ``IndexedDataset``."""

    def write(documents, name="data", vocab_size=100):
        with IndexedDatasetWriter(tmp_path / name, vocab_size) as writer:
            for document in documents:
                writer.add_document(document)
        return IndexedDataset(tmp_path / name)

    return write
