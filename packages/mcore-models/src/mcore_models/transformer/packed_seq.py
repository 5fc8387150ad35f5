"""Packed sequences: several documents in one row, told apart by ``cu_seqlens`` or position resets."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSeqParams:
    """Document boundaries of a packed batch of one row: ``cu_seqlens`` = ``[0, len0, len0+len1, ...]``."""

    cu_seqlens: torch.Tensor

    def segment_ids(self, seq_length: int) -> torch.Tensor:
        """``[1, seq_length]``: the document index of each token."""
        bounds = self.cu_seqlens.to(torch.long)
        if bounds[0] != 0 or int(bounds[-1]) != seq_length:
            raise ValueError(
                f"cu_seqlens must run from 0 to the sequence length {seq_length}, got {bounds.tolist()}"
            )
        positions = torch.arange(seq_length, device=bounds.device)
        return (torch.bucketize(positions, bounds[1:], right=True)).unsqueeze(0)

    def position_ids(self, seq_length: int) -> torch.Tensor:
        """``[1, seq_length]``: each token's position inside its document."""
        segments = self.segment_ids(seq_length)[0]
        starts = self.cu_seqlens.to(torch.long)[segments]
        return (torch.arange(seq_length, device=segments.device) - starts).unsqueeze(0)


def segments_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, s]`` document ids where ``position_ids`` restart (do not increase); ``None`` without restarts."""
    restarts = position_ids[:, 1:] <= position_ids[:, :-1]
    if not bool(restarts.any()):
        return None
    return torch.nn.functional.pad(restarts.long(), (1, 0)).cumsum(dim=-1)
