"""The unigram baseline: the loss of a model that ignores context, for comparison with training."""

import numpy as np


def unigram_cross_entropy(train_tokens: np.ndarray, heldout_tokens: np.ndarray, vocab_size: int) -> float:
    """Mean cross-entropy, in nats per token, of ``heldout_tokens`` under the token frequencies of
    ``train_tokens`` with add-one smoothing: ``p(t) = (count(t) + 1) / (len(train) + vocab_size)``.

    A language model that has learned anything beyond token frequencies scores below it.
    """
    if len(heldout_tokens) == 0:
        raise ValueError("heldout_tokens is empty")
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size)
    if len(counts) > vocab_size:
        raise ValueError(f"train_tokens hold id {len(counts) - 1}, outside vocab_size {vocab_size}")
    log_probabilities = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    heldout_counts = np.bincount(np.asarray(heldout_tokens), minlength=vocab_size)
    if len(heldout_counts) > vocab_size:
        raise ValueError(f"heldout_tokens hold id {len(heldout_counts) - 1}, outside vocab_size {vocab_size}")
    return float(-(heldout_counts @ log_probabilities) / heldout_counts.sum())
