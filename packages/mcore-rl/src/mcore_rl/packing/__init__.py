"""Sequence packing for GRPO: rollouts into fixed-length one-row bins with per-sequence boundaries
(``PackedSeqParams``), position resets, labels, loss masks and per-token advantages; label
log-probs from (vocab-parallel) logits; the GRPO loss of a bin as its share of the global batch's."""

from .logprobs import label_logprobs
from .loss import packed_grpo_loss
from .pack import PackedBatch, PackedBin, pack_sequences
from .sequence import TrainingSequence
from .unpack import unpack_completions

__all__ = [
    "PackedBatch",
    "PackedBin",
    "TrainingSequence",
    "label_logprobs",
    "pack_sequences",
    "packed_grpo_loss",
    "unpack_completions",
]
