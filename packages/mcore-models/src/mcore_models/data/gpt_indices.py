"""The three indices that turn an indexed dataset into fixed-length GPT samples, and their cache.

- document index: the order in which documents are read, one fresh permutation per epoch, as
  many epochs as it takes to provide ``num_samples * seq_length + 1`` tokens;
- sample index: for each sample, the (position in the document index, token offset) where it
  starts; sample ``i`` is the ``seq_length + 1`` tokens from ``i * seq_length`` in the stream of
  documents read in document-index order, so consecutive samples overlap by one token (the last
  label of one is the first input of the next) and samples run across document boundaries;
- shuffle index: a permutation of the samples.

All three come from one ``numpy`` generator seeded with ``seed``: the same lengths, parameters
and seed give the same indices everywhere.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mcore_api import internal_api

from mcore_models.data.cache import atomic_output

#: Bump when the way indices are built changes, so stale cache files are not reused.
INDEX_FORMAT = 1
_NAMES = ("document_index", "sample_index", "shuffle_index")


@internal_api
@dataclass(frozen=True)
class GPTIndices:
    """``document_index`` (int64[epochs * documents]), ``sample_index`` (int64[num_samples, 2])
    and ``shuffle_index`` (int64[num_samples])."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs of ``tokens_per_epoch`` tokens that provide ``num_samples`` samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset holds no tokens")
    return -(-(num_samples * seq_length + 1) // tokens_per_epoch)


def build_document_index(num_documents: int, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """``num_epochs`` permutations of ``range(num_documents)`` back to back."""
    epochs = [rng.permutation(num_documents) for _ in range(num_epochs)]
    return np.concatenate(epochs).astype(np.int64) if epochs else np.empty(0, dtype=np.int64)


def build_sample_index(
    lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """(position in ``document_index``, offset) where each of the ``num_samples`` samples starts.

    A start that falls exactly at a document's end is placed at offset 0 of the next non-empty
    document.
    """
    read_lengths = np.asarray(lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(read_lengths)
    if len(ends) == 0 or ends[-1] < num_samples * seq_length + 1:
        available = int(ends[-1]) if len(ends) else 0
        raise ValueError(
            f"{num_samples} samples of {seq_length} + 1 tokens need more than {available} tokens"
        )
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[positions] - read_lengths[positions])
    return np.stack([positions, offsets], axis=1)


@internal_api
def build_gpt_indices(lengths: np.ndarray, seq_length: int, num_samples: int, seed: int) -> GPTIndices:
    """The three indices for documents of ``lengths`` tokens."""
    if seq_length < 1 or num_samples < 1:
        raise ValueError(f"seq_length and num_samples must be positive, got {seq_length} and {num_samples}")
    rng = np.random.default_rng(seed)
    num_epochs = num_epochs_needed(int(np.sum(lengths, dtype=np.int64)), seq_length, num_samples)
    document_index = build_document_index(len(lengths), num_epochs, rng)
    sample_index = build_sample_index(lengths, document_index, seq_length, num_samples)
    return GPTIndices(document_index, sample_index, rng.permutation(num_samples).astype(np.int64))


def cached_gpt_indices(
    lengths: np.ndarray, seq_length: int, num_samples: int, seed: int, cache_dir: Path, name: str
) -> GPTIndices:
    """``build_gpt_indices``, stored once as ``<cache_dir>/<name>-<key>-<index>.npy`` and
    memory-mapped from there afterwards. ``key`` hashes the parameters and the lengths."""
    description = {
        "format": INDEX_FORMAT,
        "seq_length": seq_length,
        "num_samples": num_samples,
        "seed": seed,
        "lengths_sha256": hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    paths = {index: Path(cache_dir) / f"{name}-{key}-{index}.npy" for index in _NAMES}
    if not all(path.exists() for path in paths.values()):
        indices = build_gpt_indices(lengths, seq_length, num_samples, seed)
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        for index, path in paths.items():
            with atomic_output(path) as handle:
                np.save(handle, getattr(indices, index))
    return GPTIndices(**{index: np.load(path, mmap_mode="r") for index, path in paths.items()})
