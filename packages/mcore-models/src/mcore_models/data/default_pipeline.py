"""The default data pipeline: stdlib corpus -> tokenizer -> train/held-out indexed datasets.

``build_default_pipeline`` does every step once and caches the result under
``<cache_dir>/pipelines/``, keyed by Python version, vocabulary size and the fingerprints of both
splits; a second call (any process) only opens the files. It also records the unigram baseline,
the held-out cross-entropy of add-one-smoothed training-set token frequencies, EOD tokens
included, which a training run's held-out loss should beat.
"""

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mcore_models.data.cache import atomic_output, default_cache_dir
from mcore_models.data.corpus import corpus_fingerprint, stdlib_documents
from mcore_models.data.indexed_dataset import IndexedDataset
from mcore_models.data.preprocess import write_indexed_dataset
from mcore_models.data.tokenizer import Tokenizer, default_tokenizer
from mcore_models.data.unigram_baseline import unigram_cross_entropy

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class DefaultPipeline:
    """The built pipeline: ``train`` and ``heldout`` datasets, their ``tokenizer``, the
    ``unigram_baseline`` in nats per token, and ``summary`` (documents, bytes and tokens of each
    split) as stored in ``directory``."""

    tokenizer: Tokenizer
    train: IndexedDataset
    heldout: IndexedDataset
    unigram_baseline: float
    summary: dict
    directory: Path


def build_default_pipeline(
    vocab_size: int = 4096,
    heldout_fraction: float = 0.05,
    include_tests: bool = False,
    cache_dir: str | os.PathLike | None = None,
    workers: int = 1,
    progress: bool = True,
) -> DefaultPipeline:
    """Build (first time) or open (afterwards) the default pipeline; see the module docstring."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer = default_tokenizer(vocab_size, cache_dir, heldout_fraction, include_tests)
    corpus = dict(heldout_fraction=heldout_fraction, include_tests=include_tests)
    fingerprints = "-".join(
        corpus_fingerprint(stdlib_documents(split, **corpus)) for split in ("train", "heldout")
    )
    python = ".".join(map(str, sys.version_info[:3]))
    directory = cache_dir / "pipelines" / f"stdlib-py{python}-v{vocab_size}-{fingerprints}"
    if not (directory / SUMMARY_FILE).exists():
        _build(directory, tokenizer, corpus, workers, progress)
    summary = json.loads((directory / SUMMARY_FILE).read_text())
    return DefaultPipeline(
        tokenizer=tokenizer,
        train=IndexedDataset(directory / "train"),
        heldout=IndexedDataset(directory / "heldout"),
        unigram_baseline=summary["unigram_baseline"],
        summary=summary,
        directory=directory,
    )


def _build(directory: Path, tokenizer: Tokenizer, corpus: dict, workers: int, progress: bool) -> None:
    """Write the datasets and summary into a fresh folder, then move it to ``directory``."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        summary, datasets = {}, {}
        for split in ("train", "heldout"):
            texts = [document.text for document in stdlib_documents(split, **corpus)]
            datasets[split] = write_indexed_dataset(
                texts, staging / split, tokenizer, workers=workers, progress=progress
            )
            summary[split] = {
                "documents": len(texts),
                "bytes": sum(len(text.encode()) for text in texts),
                "tokens": datasets[split].num_tokens,
            }
        summary["unigram_baseline"] = unigram_cross_entropy(
            datasets["train"].tokens, datasets["heldout"].tokens, tokenizer.vocab_size
        )
        with atomic_output(staging / SUMMARY_FILE, "w") as handle:
            json.dump(summary, handle, indent=2)
        try:
            os.replace(staging, directory)
        except OSError:
            if not (directory / SUMMARY_FILE).exists():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
