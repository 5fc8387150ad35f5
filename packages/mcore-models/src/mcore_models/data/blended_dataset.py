"""``BlendedDataset``: several datasets interleaved so each contributes its weight's share.

The ``j``-th sample of dataset ``d`` (normalized weight ``w_d``) is due at ``(j + 0.5) / w_d``;
the blend takes samples in order of due time, ties going to the lower dataset index. After any
``n`` samples, dataset ``d`` has given ``w_d * n`` of them up to rounding, and the order is a
pure function of the weights and the size, so it is the same everywhere without a cache.
"""

from collections.abc import Sequence

import numpy as np
from mcore_api import internal_api


@internal_api
def blend_order(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)``: which dataset, and which of its samples, is
    sample ``i`` of a blend of ``size`` samples with ``weights``."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or len(weights) == 0 or not np.all(weights >= 0) or weights.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights.tolist()}")
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    weights = weights / weights.sum()
    candidates = [np.arange(int(np.ceil(w * size)) + 1) if w > 0 else np.arange(0) for w in weights]
    due = np.concatenate([(j + 0.5) / w for j, w in zip(candidates, weights, strict=True) if w > 0])
    dataset = np.concatenate([np.full(len(j), d) for d, j in enumerate(candidates)])
    order = np.lexsort((dataset, due))[:size]
    return dataset[order].astype(np.int64), np.concatenate(candidates)[order].astype(np.int64)


def blended_dataset_sizes(weights: Sequence[float], size: int) -> list[int]:
    """How many samples each dataset must provide to a blend of ``size`` samples."""
    dataset_index, _ = blend_order(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in the proportions of ``weights``.

    Build each dataset with at least ``blended_dataset_sizes(weights, size)[d]`` samples.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = list(weights)
        self.dataset_index, self.dataset_sample_index = blend_order(weights, size)
        for d, needed in enumerate(np.bincount(self.dataset_index, minlength=len(datasets))):
            if len(self.datasets[d]) < needed:
                raise ValueError(f"dataset {d} has {len(self.datasets[d])} samples, the blend needs {needed}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]
