"""BlendedDataset: shares match weights at every prefix, routing, sizes and bad input."""

import numpy as np
import pytest
from mcore_models.data.blended_dataset import BlendedDataset, blend_order, blended_dataset_sizes


def test_blend_order_by_hand():
    # due times: dataset 0 at 1, 3, 5, 7; datasets 1 and 2 at 2, 6
    dataset_index, sample_index = blend_order([0.5, 0.25, 0.25], 8)
    assert dataset_index.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert sample_index.tolist() == [0, 0, 0, 1, 2, 1, 1, 3]


@pytest.mark.parametrize("weights", [[3, 1, 1], [0.7, 0.2, 0.1], [1, 1], [0.05, 0.9, 0.03, 0.02], [1, 0, 2]])
def test_every_prefix_matches_the_weights_within_one_sample(weights):
    size = 1000
    dataset_index, sample_index = blend_order(weights, size)
    shares = np.asarray(weights) / np.sum(weights)
    seen = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset_index], axis=0)  # counts after each sample
    expected = np.outer(np.arange(1, size + 1), shares)
    assert np.abs(seen - expected).max() <= 1.0
    assert blended_dataset_sizes(weights, size) == seen[-1].tolist()
    for d in range(len(weights)):  # each dataset's samples are taken in order, none twice
        assert sample_index[dataset_index == d].tolist() == list(range(seen[-1][d]))


def test_sizes_for_round_weights():
    assert blended_dataset_sizes([3, 1, 1], 1000) == [600, 200, 200]
    assert blended_dataset_sizes([1, 0], 5) == [5, 0]


def test_samples_come_from_the_right_dataset():
    letters, numbers = [f"a{i}" for i in range(10)], list(range(10))
    blend = BlendedDataset([letters, numbers], [2, 1], 9)
    assert len(blend) == 9
    assert [blend[i] for i in range(9)] == ["a0", 0, "a1", "a2", 1, "a3", "a4", 2, "a5"]
    with pytest.raises(IndexError):
        blend[9]


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="dataset 1 has 2 samples, the blend needs 3"):
        BlendedDataset([list(range(10)), [0, 1]], [2, 1], 9)
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        BlendedDataset([[0], [1]], [1], 1)
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        blend_order([1, -1], 4)
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        blend_order([0, 0], 4)
