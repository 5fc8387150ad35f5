"""Helpers shared by the data tests."""

import itertools

import pytest
from mcore_models.data.corpus import stdlib_documents
from mcore_models.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mcore_models.data.tokenizer import train_bpe_tokenizer


@pytest.fixture(scope="session")
def ascii_stdlib_texts():
    """Thirty ASCII-only stdlib files: their text survives any decode/encode round trip."""
    return [
        document.text
        for document in itertools.islice((d for d in stdlib_documents() if d.text.isascii()), 30)
    ]


@pytest.fixture(scope="session")
def small_tokenizer(ascii_stdlib_texts):
    """A 600-token BPE trained on ``ascii_stdlib_texts`` (EOD 0, pad 1, FIM sentinels 2..5)."""
    return train_bpe_tokenizer(ascii_stdlib_texts, vocab_size=600)


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
