"""``pack_sequences``: rollouts into fixed-length one-row bins, with everything a packed GRPO step needs."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mcore_api import experimental_api
from mcore_models import PackedSeqParams

from .first_fit import first_fit_decreasing
from .sequence import CheckedSequence, TrainingSequence, check_sequence

IGNORE_INDEX = -100
"""The label of a position that predicts nothing: the last token of a sequence, and padding."""


@experimental_api
@dataclass(frozen=True)
class PackedBin:
    """One packed row of ``L`` tokens: whole sequences one after another, then padding.

    Every tensor is ``[1, L]``. Position ``t`` predicts ``labels[0, t]``; the per-token values
    (``advantages``, ``sampling_logprobs``, ``ref_logprobs``) sit at the positions that predict a
    completion token, where ``loss_mask`` is ``True``, and are 0 elsewhere."""

    tokens: torch.Tensor
    """Token ids (long); padding holds the pad id."""
    position_ids: torch.Tensor
    """Each token's position in its own sequence (the padding counts as one more sequence)."""
    packed_seq_params: PackedSeqParams
    """``cu_seqlens`` (int32): the sequence boundaries, the padding being the last segment."""
    labels: torch.Tensor
    """The next token of the same sequence, ``IGNORE_INDEX`` (-100) at its last token and on padding."""
    loss_mask: torch.Tensor
    """Bool: ``True`` exactly where the label is a completion token."""
    advantages: torch.Tensor
    """Float32: the sequence's advantage on its masked positions."""
    sampling_logprobs: torch.Tensor
    """Float32: the inference engine's log-prob of the label on masked positions."""
    ref_logprobs: torch.Tensor | None
    """Float32: the reference policy's log-prob of the label on masked positions, when given."""
    sequence_index: torch.Tensor
    """Long: the index (in the packed list) of each token's sequence, -1 on padding."""

    @property
    def num_sequences(self) -> int:
        """How many sequences the bin holds (0 for a padding bin)."""
        return len(self.packed_seq_params.cu_seqlens) - 1 - int(self.padding > 0)

    @property
    def padding(self) -> int:
        """How many padding tokens end the bin."""
        return int((self.sequence_index[0] < 0).sum())


@experimental_api
@dataclass(frozen=True)
class PackedBatch:
    """What ``pack_sequences`` returns: the bins, the global loss normalisers, and the DP split."""

    bins: tuple[PackedBin, ...]
    """A multiple of ``data_parallel_size`` bins, the fullest first; padding bins (mask all 0) last."""
    num_sequences: int
    """Sequences in the whole batch: ``packed_grpo_loss``'s normaliser for ``sequence_mean``."""
    num_tokens: int
    """Completion tokens in the whole batch: the normaliser for ``token_mean``."""
    data_parallel_size: int

    def data_parallel_bins(self, rank: int) -> tuple[PackedBin, ...]:
        """The bins of data-parallel ``rank``: every ``data_parallel_size``-th, from ``rank``."""
        if not isinstance(rank, numbers.Integral) or not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"rank: must be an int in [0, {self.data_parallel_size}), got {rank!r}")
        return self.bins[rank :: self.data_parallel_size]


@experimental_api
def pack_sequences(
    sequences: Sequence[TrainingSequence],
    bin_length: int,
    *,
    data_parallel_size: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack ``sequences`` (prompt + completion each) into bins of ``bin_length`` tokens by
    first-fit-decreasing, each sequence whole in one bin; then add empty bins until their number
    is a multiple of ``data_parallel_size``. Deterministic.

    Raises ``TypeError``/``ValueError`` naming the culprit (``sequences[i].field``): a sequence
    longer than ``bin_length``, an empty prompt or completion, log-probs not one per completion
    token or not finite, a non-finite advantage; ``bin_length`` < 2; no sequences.
    """
    _check_int("bin_length", bin_length, 2)
    _check_int("data_parallel_size", data_parallel_size, 1)
    _check_int("pad_token_id", pad_token_id, 0)
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise TypeError(
            f"sequences: must be a list or tuple of TrainingSequence, got {type(sequences).__name__}"
        )
    if len(sequences) == 0:
        raise ValueError("sequences: must not be empty")
    checked = [check_sequence(sequence, f"sequences[{i}]") for i, sequence in enumerate(sequences)]
    for i, sequence in enumerate(checked):
        if len(sequence) > bin_length:
            raise ValueError(
                f"sequences[{i}]: {len(sequence.prompt_ids)} prompt + {len(sequence.completion_ids)} "
                f"completion tokens do not fit in bin_length {bin_length}"
            )
    groups = first_fit_decreasing([len(sequence) for sequence in checked], bin_length)
    groups += [[] for _ in range(-len(groups) % data_parallel_size)]
    with_ref = [sequence.ref_logprobs is not None for sequence in checked]
    if any(with_ref) and not all(with_ref):
        raise ValueError(
            f"sequences[{with_ref.index(False)}].ref_logprobs: given for some sequences, so needed for all"
        )
    bins = tuple(_pack_bin(checked, members, bin_length, pad_token_id, all(with_ref)) for members in groups)
    return PackedBatch(
        bins=bins,
        num_sequences=len(checked),
        num_tokens=sum(len(sequence.completion_ids) for sequence in checked),
        data_parallel_size=data_parallel_size,
    )


def _pack_bin(
    sequences: list[CheckedSequence], members: list[int], length: int, pad_token_id: int, with_ref: bool
) -> PackedBin:
    tokens = torch.full((length,), pad_token_id, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    owner = torch.full((length,), -1, dtype=torch.long)
    mask = torch.zeros(length, dtype=torch.bool)
    advantages, sampling, ref = (torch.zeros(length) for _ in range(3))
    bounds = [0]
    for index in members:
        sequence = sequences[index]
        start, prompt = bounds[-1], len(sequence.prompt_ids)
        end = start + len(sequence)
        tokens[start:end] = torch.cat([sequence.prompt_ids, sequence.completion_ids])
        labels[start : end - 1] = tokens[start + 1 : end]
        owner[start:end] = index
        predicting = slice(start + prompt - 1, end - 1)  # the positions whose label is a completion token
        mask[predicting] = True
        advantages[predicting] = sequence.advantage
        sampling[predicting] = sequence.sampling_logprobs
        if with_ref:
            ref[predicting] = sequence.ref_logprobs
        bounds.append(end)
    if bounds[-1] < length:
        bounds.append(length)
    params = PackedSeqParams(cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    return PackedBin(
        tokens=tokens[None],
        position_ids=params.position_ids(length),
        packed_seq_params=params,
        labels=labels[None],
        loss_mask=mask[None],
        advantages=advantages[None],
        sampling_logprobs=sampling[None],
        ref_logprobs=ref[None] if with_ref else None,
        sequence_index=owner[None],
    )


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
