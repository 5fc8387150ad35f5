"""Training and held-out data: the default stdlib pipeline or your own indexed datasets, and the
micro-batches of one iteration.

The samples of 1-based iteration ``i`` are ``(i - 1) * G ... i * G - 1`` of the dataset, ``G`` the
global batch; micro-batch ``m`` of data-parallel rank ``r`` holds samples ``(m * dp + r) * mbs``
onwards within them. So the data of an iteration depends only on ``i``: a resumed run sees what
the uninterrupted one saw, and every layout with the same global batch trains on the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mcore_api import internal_api

from ..data.default_pipeline import build_default_pipeline
from ..data.fim_dataset import FIMConfig, GPTFIMDataset
from ..data.gpt_dataset import GPTDataset, GPTDatasetConfig
from ..data.indexed_dataset import IndexedDataset
from ..data.tokenizer import Tokenizer
from ..data.unigram_baseline import unigram_cross_entropy
from .config import DataConfig


@internal_api
@dataclass
class TrainData:
    """The training and held-out ``GPTDataset``, their tokenizer and the held-out unigram baseline."""

    train: GPTDataset
    heldout: GPTDataset
    tokenizer: Tokenizer
    unigram_baseline: float


@internal_api
def open_indexed_data(
    config: DataConfig, progress: bool = False
) -> tuple[IndexedDataset, IndexedDataset, Tokenizer, float]:
    """The training and held-out token datasets, their tokenizer and the unigram baseline.

    The default pipeline is built on first use (about 20 s on 2 cores) and cached afterwards.
    """
    if config.data_path is None:
        pipeline = build_default_pipeline(
            config.vocab_size, cache_dir=config.data_cache_dir, progress=progress
        )
        return pipeline.train, pipeline.heldout, pipeline.tokenizer, pipeline.unigram_baseline
    tokenizer = Tokenizer.from_file(config.tokenizer_file)
    train, heldout = IndexedDataset(config.data_path), IndexedDataset(config.heldout_data_path)
    baseline = unigram_cross_entropy(train.tokens, heldout.tokens, tokenizer.vocab_size)
    return train, heldout, tokenizer, baseline


@internal_api
def open_train_data(
    config: DataConfig, seed: int, train_samples: int, heldout_samples: int, progress: bool = False
) -> TrainData:
    """``GPTDataset`` views with ``train_samples`` and ``heldout_samples`` samples.

    The training view of the default corpus is a ``GPTFIMDataset`` when ``config.fim`` is set."""
    train, heldout, tokenizer, baseline = open_indexed_data(config, progress)

    def dataset(indexed: IndexedDataset, samples: int, dataset_seed: int, fim: bool = False) -> GPTDataset:
        dataset_config = GPTDatasetConfig(
            seq_length=config.seq_length,
            num_samples=samples,
            eod_id=tokenizer.eod_id,
            pad_id=tokenizer.pad_id,
            seed=dataset_seed,
            reset_position_ids=config.reset_position_ids,
            eod_mask_loss=config.eod_mask_loss,
            allow_ambiguous_pad_tokens=True,
        )
        if not fim:
            return GPTDataset(indexed, dataset_config)
        fim_config = FIMConfig(
            fim_rate=config.fim_rate,
            fim_spm_rate=config.fim_spm_rate,
            fim_split_sample=config.fim_split_sample,
            fim_fragment_rate=config.fim_fragment_rate,
        )
        return GPTFIMDataset(indexed, dataset_config, fim_config, tokenizer)

    fim = config.fim and config.data_path is None
    return TrainData(
        dataset(train, train_samples, seed, fim),
        dataset(heldout, heldout_samples, seed + 1),
        tokenizer,
        baseline,
    )


@internal_api
def iteration_micro_batches(
    dataset: GPTDataset,
    iteration: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of 1-based ``iteration`` for data-parallel rank ``dp_rank`` (see the module doc)."""
    first = (iteration - 1) * global_batch_size
    count = global_batch_size // (micro_batch_size * dp_size)
    batches = []
    for micro in range(count):
        start = first + (micro * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[(start + k) % len(dataset)] for k in range(micro_batch_size)]
        batches.append({key: torch.stack([s[key] for s in samples]).to(device) for key in samples[0]})
    return batches
