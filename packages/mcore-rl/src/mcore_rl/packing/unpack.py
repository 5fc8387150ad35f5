"""Per-token values of a packed bin back into one row per sequence: the completion tokens only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mcore_api import experimental_api

from .pack import PackedBin


@dataclass(frozen=True)
class CompletionRows:
    """Where a bin's completion tokens go in ``[n, max completion length]`` rows (n sequences)."""

    positions: torch.Tensor
    """``[m]``: the bin positions of the masked tokens, in order."""
    row: torch.Tensor
    col: torch.Tensor
    sequence_index: torch.Tensor
    """``[n]``: the global index of each row's sequence."""
    lengths: torch.Tensor
    """``[n]``: each row's completion length."""

    @classmethod
    def of(cls, packed_bin: PackedBin) -> CompletionRows:
        """The completions of ``packed_bin``."""
        return cls.of_rows(packed_bin.loss_mask, packed_bin.sequence_index)

    @classmethod
    def of_rows(cls, loss_mask: torch.Tensor, sequence_index: torch.Tensor) -> CompletionRows:
        """The completions of bins stacked as rows (``[k, L]`` masks and sequence indices, each
        sequence in one row): ``positions`` index the flattened rows."""
        positions = loss_mask.reshape(-1).nonzero().squeeze(1)
        owners = sequence_index.reshape(-1)[positions]
        sequence_index, lengths = torch.unique_consecutive(owners, return_counts=True)
        row = torch.repeat_interleave(torch.arange(len(lengths), device=owners.device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        col = torch.arange(len(positions), device=owners.device) - starts[row]
        return cls(positions, row, col, sequence_index, lengths)

    def mask(self) -> torch.Tensor:
        """``[n, T]`` bool: the completion tokens of each row."""
        width = int(self.lengths.max())
        return torch.arange(width, device=self.lengths.device) < self.lengths[:, None]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[n, T]``: ``values`` (``[k, L]``, the rows these completions were found in) at the
        completion tokens, 0 elsewhere; differentiable."""
        device = values.device
        rows = values.new_zeros(len(self.lengths), int(self.lengths.max()))
        picked = values.reshape(-1)[self.positions.to(device)]
        return rows.index_put((self.row.to(device), self.col.to(device)), picked)


@experimental_api
def unpack_completions(values: Sequence[torch.Tensor], bins: Sequence[PackedBin]) -> dict[int, torch.Tensor]:
    """Per-token ``values`` of packed bins (one ``[1, L]`` tensor per bin, e.g. ``label_logprobs``
    of the model's logits) as ``{sequence index: [completion length]}``, in increasing index:
    each completion's values in token order. Differentiable in ``values``.

    Raises ``ValueError`` naming the argument when the counts or shapes do not match the bins."""
    if len(values) != len(bins):
        raise ValueError(f"values: must hold one tensor per bin ({len(bins)}), got {len(values)}")
    unpacked = {}
    for b, (value, packed_bin) in enumerate(zip(values, bins, strict=True)):
        if not isinstance(value, torch.Tensor) or value.shape != packed_bin.tokens.shape:
            raise ValueError(
                f"values[{b}]: must be a tensor of the bin's shape {tuple(packed_bin.tokens.shape)}, "
                f"got {getattr(value, 'shape', type(value).__name__)}"
            )
        if packed_bin.num_sequences == 0:
            continue
        rows = CompletionRows.of(packed_bin)
        gathered = rows.gather(value)
        for r, index in enumerate(rows.sequence_index.tolist()):
            unpacked[index] = gathered[r, : int(rows.lengths[r])]
    return dict(sorted(unpacked.items()))
