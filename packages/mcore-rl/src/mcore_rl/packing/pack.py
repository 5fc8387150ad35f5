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
    bins = _pack_bins(checked, groups, bin_length, pad_token_id, all(with_ref))
    return PackedBatch(
        bins=bins,
        num_sequences=len(checked),
        num_tokens=sum(len(sequence.completion_ids) for sequence in checked),
        data_parallel_size=data_parallel_size,
    )


def _pack_bins(
    sequences: list[CheckedSequence], groups: list[list[int]], length: int, pad_token_id: int, with_ref: bool
) -> tuple[PackedBin, ...]:
    """One bin per member list of ``groups``: its rows built as Python lists, each field made a
    ``[bins, length]`` tensor at once, every bin a row of them."""
    names = ("tokens", "positions", "labels", "owner", "mask", "advantages", "sampling", "ref")
    fields = {name: [] for name in names}
    bounds_of = []
    for members in groups:
        row = {name: [] for name in fields}
        bounds = [0]
        for index in members:
            _append_sequence(row, sequences[index], index, with_ref)
            bounds.append(len(row["tokens"]))
        padding = length - bounds[-1]
        if padding:
            bounds.append(length)
        for name, values in row.items():
            if name == "positions":  # the padding counts as one more sequence
                values.extend(range(padding))
            else:
                values.extend([pad_token_id if name == "tokens" else _PADDING[name]] * padding)
            fields[name].append(values)
        bounds_of.append(bounds)
    tensors = {
        name: torch.tensor(rows, dtype=_DTYPES[name]).view(len(groups), length)
        for name, rows in fields.items()
    }
    bins = []
    for b, bounds in enumerate(bounds_of):
        params = PackedSeqParams(cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        bins.append(
            PackedBin(
                tokens=tensors["tokens"][b : b + 1],
                position_ids=tensors["positions"][b : b + 1],
                packed_seq_params=params,
                labels=tensors["labels"][b : b + 1],
                loss_mask=tensors["mask"][b : b + 1],
                advantages=tensors["advantages"][b : b + 1],
                sampling_logprobs=tensors["sampling"][b : b + 1],
                ref_logprobs=tensors["ref"][b : b + 1] if with_ref else None,
                sequence_index=tensors["owner"][b : b + 1],
            )
        )
    return tuple(bins)


_PADDING = {
    "labels": IGNORE_INDEX,
    "owner": -1,
    "mask": False,
    "advantages": 0.0,
    "sampling": 0.0,
    "ref": 0.0,
}
_DTYPES = {name: torch.long for name in ("tokens", "positions", "labels", "owner")} | {"mask": torch.bool}
_DTYPES |= {"advantages": torch.float32, "sampling": torch.float32, "ref": torch.float32}


def _append_sequence(row: dict[str, list], sequence: CheckedSequence, index: int, with_ref: bool) -> None:
    """Add ``sequence`` (number ``index`` of the batch) to the end of ``row``'s lists: its tokens,
    labels (the next token, ``IGNORE_INDEX`` at its last), and the per-token values at the
    positions that predict a completion token."""
    prompt, completion = sequence.prompt_ids, sequence.completion_ids
    tokens = prompt + completion
    before, after = [0.0] * (len(prompt) - 1), [0.0]  # the positions around the predicting ones
    row["tokens"] += tokens
    row["positions"] += range(len(tokens))
    row["labels"] += [*tokens[1:], IGNORE_INDEX]
    row["owner"] += [index] * len(tokens)
    row["mask"] += [False] * len(before) + [True] * len(completion) + [False]
    row["advantages"] += before + [sequence.advantage] * len(completion) + after
    row["sampling"] += before + sequence.sampling_logprobs + after
    row["ref"] += before + (sequence.ref_logprobs if with_ref else [0.0] * len(completion)) + after


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
