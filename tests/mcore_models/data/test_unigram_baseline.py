"""The unigram baseline against a hand-computed value."""

import math

import numpy as np
import pytest
from mcore_models.data.unigram_baseline import unigram_cross_entropy


def test_add_one_smoothed_cross_entropy_by_hand():
    # counts 2, 1, 1, 0 of 4 tokens, vocabulary 4: p = 3/8, 2/8, 2/8, 1/8
    value = unigram_cross_entropy(np.array([0, 0, 1, 2]), np.array([0, 3]), vocab_size=4)
    assert value == pytest.approx(-(math.log(3 / 8) + math.log(1 / 8)) / 2)


def test_uniform_when_training_saw_nothing():
    value = unigram_cross_entropy(np.array([], dtype=np.int64), np.array([1, 2, 3]), vocab_size=7)
    assert value == pytest.approx(math.log(7))


def test_out_of_vocabulary_ids_and_empty_heldout_are_rejected():
    with pytest.raises(ValueError, match="heldout_tokens hold id 5, outside vocab_size 4"):
        unigram_cross_entropy(np.array([0]), np.array([5]), vocab_size=4)
    with pytest.raises(ValueError, match="heldout_tokens is empty"):
        unigram_cross_entropy(np.array([0]), np.array([], dtype=np.int64), vocab_size=4)
