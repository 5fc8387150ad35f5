"""Indexed binary datasets: token sequences in a flat ``.bin`` file, described by an ``.idx`` file.

``<prefix>.bin`` holds every sequence's tokens back to back in one integer dtype, the smallest
that holds the vocabulary. ``<prefix>.idx`` holds, little-endian::

    magic          8 bytes   b"MCOREIDX"
    version        uint32    1
    dtype code     uint8     1 uint8, 2 uint16, 3 uint32, 4 int64
    (padding)      3 bytes
    num_sequences  uint64    S
    num_documents  uint64    D
    lengths        int32[S]  tokens per sequence
    pointers       int64[S]  byte offset of each sequence in the .bin
    doc_indices    int64[D+1] index of each document's first sequence, then S

A document is one or more consecutive sequences (usually one). Both files are memory-mapped;
reading a sequence touches only its bytes.
"""

import os
import shutil
import struct
from pathlib import Path

import numpy as np
from mcore_api import internal_api

MAGIC = b"MCOREIDX"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xQQ")
_DTYPE_CODES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 3: np.dtype(np.uint32), 4: np.dtype(np.int64)}
_CODE_OF_DTYPE = {dtype: code for code, dtype in _DTYPE_CODES.items()}
_COPY_CHUNK_BYTES = 64 << 20


class IndexedDatasetFormatError(ValueError):
    """A file is not a readable indexed dataset (wrong magic, version, dtype or size)."""


@internal_api
def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    for dtype in _DTYPE_CODES.values():
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"vocab_size {vocab_size} does not fit in int64")


def bin_path(path_prefix: str | os.PathLike) -> Path:
    """The ``.bin`` file of a dataset prefix."""
    return Path(f"{os.fspath(path_prefix)}.bin")


def idx_path(path_prefix: str | os.PathLike) -> Path:
    """The ``.idx`` file of a dataset prefix."""
    return Path(f"{os.fspath(path_prefix)}.idx")


class IndexedDatasetWriter:
    """Writes ``<path_prefix>.bin`` while sequences are added, ``<path_prefix>.idx`` on ``finalize``.

    Use as a context manager: leaving the block finalizes, or, on an exception, deletes both
    files. Sequences added after the last ``end_document`` form one more document at finalize.
    """

    def __init__(self, path_prefix: str | os.PathLike, vocab_size: int):
        self.path_prefix = Path(path_prefix)
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.path_prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(bin_path(self.path_prefix), "wb")  # closed in finalize or abort
        self._lengths: list[int] = []
        self._document_indices = [0]

    def add_sequence(self, tokens) -> None:
        """Append one sequence of token ids (any integer array-like)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.vocab_size}), got [{array.min()}, {array.max()}]"
            )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(len(array))

    def end_document(self) -> None:
        """Close the current document after the sequences added since the previous one."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """Append a document made of the single sequence ``tokens``."""
        self.add_sequence(tokens)
        self.end_document()

    def add_dataset(self, path_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of the indexed dataset at ``path_prefix``."""
        other = IndexedDataset(path_prefix)
        if other.dtype.itemsize > self.dtype.itemsize:
            raise ValueError(
                f"{path_prefix} holds {other.dtype} tokens, wider than this writer's {self.dtype}"
            )
        if self._document_indices[-1] != len(self._lengths):
            self.end_document()
        if other.dtype == self.dtype:
            with open(bin_path(path_prefix), "rb") as source:
                shutil.copyfileobj(source, self._bin, _COPY_CHUNK_BYTES)
        else:
            step = _COPY_CHUNK_BYTES // other.dtype.itemsize
            for start in range(0, other.num_tokens, step):
                self._bin.write(other.tokens[start : start + step].astype(self.dtype).tobytes())
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())

    def finalize(self) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._bin.close()
        if self._document_indices[-1] != len(self._lengths):
            self.end_document()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        header = _HEADER.pack(
            MAGIC, VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(self._document_indices) - 1
        )
        with open(idx_path(self.path_prefix), "wb") as index:
            index.write(header)
            index.write(lengths.tobytes())
            index.write(pointers.tobytes())
            index.write(np.asarray(self._document_indices, dtype=np.int64).tobytes())

    def abort(self) -> None:
        """Close and delete whatever was written."""
        self._bin.close()
        for path in (bin_path(self.path_prefix), idx_path(self.path_prefix)):
            path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of the indexed dataset at ``path_prefix``.

    ``dataset[i]`` is sequence ``i`` as a numpy array; ``dataset.get(i, offset, length)`` a slice
    of it. ``sequence_lengths``, ``sequence_pointers`` and ``document_indices`` are the index
    arrays, memory-mapped too.
    """

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = Path(path_prefix)
        index_file, data_file = idx_path(path_prefix), bin_path(path_prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset file {path} does not exist")
        with open(index_file, "rb") as index:
            raw_header = index.read(_HEADER.size)
        if len(raw_header) < _HEADER.size or raw_header[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetFormatError(
                f"{index_file} is not an mcore indexed dataset index (it does not start with {MAGIC!r})"
            )
        _, version, dtype_code, num_sequences, num_documents = _HEADER.unpack(raw_header)
        if version != VERSION:
            raise IndexedDatasetFormatError(
                f"{index_file} has format version {version}; this reader reads {VERSION}"
            )
        if dtype_code not in _DTYPE_CODES:
            raise IndexedDatasetFormatError(f"{index_file} names unknown dtype code {dtype_code}")
        self.dtype = _DTYPE_CODES[dtype_code]
        expected_index_size = _HEADER.size + 12 * num_sequences + 8 * (num_documents + 1)
        if index_file.stat().st_size != expected_index_size:
            raise IndexedDatasetFormatError(
                f"{index_file} is {index_file.stat().st_size} bytes, its header implies {expected_index_size}"
            )
        offset = _HEADER.size
        self.sequence_lengths = _map(index_file, np.int32, offset, num_sequences)
        offset += 4 * num_sequences
        self.sequence_pointers = _map(index_file, np.int64, offset, num_sequences)
        offset += 8 * num_sequences
        self.document_indices = _map(index_file, np.int64, offset, num_documents + 1)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        if data_file.stat().st_size != self.num_tokens * self.dtype.itemsize:
            raise IndexedDatasetFormatError(
                f"{data_file} is {data_file.stat().st_size} bytes, the index describes "
                f"{self.num_tokens} tokens of {self.dtype}"
            )
        self.tokens = _map(data_file, self.dtype, 0, self.num_tokens)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (each one or more consecutive sequences)."""
        return len(self.document_indices) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        """Sequence ``index`` (negative counts from the end), copied out of the map."""
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens of sequence ``index`` from ``offset`` (to its end when ``None``)."""
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"sequence index {index} out of range for {size} sequences")
        index %= size
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"slice [{offset}, {offset + length}) out of range for sequence {index} of length {sequence_length}"
            )
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return np.array(self.tokens[start : start + length])


def merge_indexed_datasets(output_prefix: str | os.PathLike, input_prefixes) -> IndexedDataset:
    """Concatenate the indexed datasets at ``input_prefixes`` into one at ``output_prefix``, in
    the widest of their dtypes; returns the merged dataset."""
    inputs = [IndexedDataset(prefix) for prefix in input_prefixes]
    if not inputs:
        raise ValueError("input_prefixes is empty")
    widest = max((dataset.dtype for dataset in inputs), key=lambda dtype: dtype.itemsize)
    with IndexedDatasetWriter(output_prefix, vocab_size=int(np.iinfo(widest).max) + 1) as writer:
        for dataset in inputs:
            writer.add_dataset(dataset.path_prefix)
    return IndexedDataset(output_prefix)


def _map(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` at byte ``offset`` of ``path``, memory-mapped (mmap cannot map
    zero bytes, so an empty array stands in then)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
