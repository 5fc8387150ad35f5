"""``GPTDataset``: fixed-length next-token-prediction samples from an indexed dataset.

Each sequence of the indexed dataset is one document (what ``mcore-preprocess`` writes, EOD
included). Documents are shuffled per epoch and read as one stream, cut into samples of
``seq_length + 1`` tokens that may span several documents (see ``gpt_indices``). A sample is a
dict of ``seq_length``-long tensors:

- ``tokens``: the inputs, ``labels``: the inputs shifted by one (the targets);
- ``loss_mask``: 1.0 where the loss counts; 0.0 where the label is the pad id, and, with
  ``eod_mask_loss``, where the input is the EOD id (the next document's first token cannot be
  predicted);
- ``position_ids``: 0, 1, ...; with ``reset_position_ids`` they restart at 0 after every EOD.

The attention mask is causal and implied; none is returned.

Pad and EOD may share an id: a tokenizer without a pad token pads with EOD. Then masking the pad
id in the loss masks every real EOD label too, and the model never learns to end a document.
``GPTDataset`` warns about that collision (``AmbiguousPadTokenWarning``) and masks anyway;
``allow_ambiguous_pad_tokens=True`` says the collision is known and accepted, and silences it.
Give the dataset a distinct pad id (the tokenizers trained here have ``<pad>``) to avoid it.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mcore_models.data.gpt_indices import cached_gpt_indices
from mcore_models.data.indexed_dataset import IndexedDataset


class AmbiguousPadTokenWarning(UserWarning):
    """The pad id equals another special id, so masking pad in the loss masks that token too."""


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How ``GPTDataset`` cuts and labels samples.

    ``eod_id``/``pad_id`` come from the tokenizer; ``pad_id=None`` means no pad masking.
    ``index_cache_dir`` holds the cached indices; ``None`` puts them next to the data.
    """

    seq_length: int
    num_samples: int
    eod_id: int
    pad_id: int | None = None
    seed: int = 1234
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    allow_ambiguous_pad_tokens: bool = False
    index_cache_dir: str | None = None

    def __post_init__(self):
        for field in ("seq_length", "num_samples"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")


class GPTDataset(torch.utils.data.Dataset):
    """``config.num_samples`` samples of ``config.seq_length`` tokens from ``indexed_dataset``,
    shuffled deterministically by ``config.seed``; indices are cached on disk and reused."""

    def __init__(self, indexed_dataset: IndexedDataset, config: GPTDatasetConfig):
        self.indexed_dataset = indexed_dataset
        self.config = config
        self._warn_if_pad_is_ambiguous()
        prefix = Path(indexed_dataset.path_prefix)
        cache_dir = Path(config.index_cache_dir) if config.index_cache_dir is not None else prefix.parent
        self.indices = cached_gpt_indices(
            np.asarray(indexed_dataset.sequence_lengths),
            config.seq_length,
            config.num_samples,
            config.seed,
            cache_dir,
            name=f"{prefix.name}-gpt",
        )

    def __len__(self) -> int:
        return self.config.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._sample_dict(self.sample_tokens(index))

    def sample_tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` (after shuffling), as int64."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        position, offset = (
            int(value) for value in self.indices.sample_index[self.indices.shuffle_index[index]]
        )
        lengths = self.indexed_dataset.sequence_lengths
        needed, pieces = self.config.seq_length + 1, []
        while needed > 0:
            document = int(self.indices.document_index[position])
            take = min(needed, int(lengths[document]) - offset)
            pieces.append(self.indexed_dataset.get(document, offset, take))
            needed, position, offset = needed - take, position + 1, 0
        return np.concatenate(pieces).astype(np.int64)

    def _sample_dict(self, sample: np.ndarray) -> dict[str, torch.Tensor]:
        """The training dict of one sample of ``seq_length + 1`` tokens."""
        tokens, labels = sample[:-1], sample[1:]
        loss_mask = np.ones(len(tokens), dtype=np.float32)
        if self.config.pad_id is not None:
            loss_mask[labels == self.config.pad_id] = 0.0
        if self.config.eod_mask_loss:
            loss_mask[tokens == self.config.eod_id] = 0.0
        position_ids = np.arange(len(tokens), dtype=np.int64)
        if self.config.reset_position_ids:
            is_start = np.zeros(len(tokens), dtype=bool)
            is_start[1:] = tokens[:-1] == self.config.eod_id
            document_start = np.maximum.accumulate(np.where(is_start, position_ids, 0))
            position_ids = position_ids - document_start
        return {
            "tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
            "labels": torch.from_numpy(np.ascontiguousarray(labels)),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
        }

    def _other_special_ids(self) -> dict[str, int | None]:
        """The special ids, besides pad, that the pad id must not equal."""
        return {"eod_id": self.config.eod_id}

    def _warn_if_pad_is_ambiguous(self) -> None:
        if self.config.pad_id is None or self.config.allow_ambiguous_pad_tokens:
            return
        clashes = [
            name for name, token_id in self._other_special_ids().items() if token_id == self.config.pad_id
        ]
        if clashes:
            warnings.warn(
                f"pad_id {self.config.pad_id} equals {', '.join(clashes)}: masking pad tokens in the loss "
                "also masks those tokens. Use a tokenizer with a distinct pad token, or pass "
                "allow_ambiguous_pad_tokens=True to accept this.",
                AmbiguousPadTokenWarning,
                stacklevel=3,
            )
