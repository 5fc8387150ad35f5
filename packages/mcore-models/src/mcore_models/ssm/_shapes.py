"""Shape checks shared by the SSD scan, its reference recurrence and the decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SSDDims:
    """The sizes an SSD call works with, read off its inputs."""

    batch: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups


def require_shape(
    name: str, tensor: torch.Tensor, expected: tuple[int, ...], layout: str, context: str
) -> None:
    """Raise ``ValueError`` unless ``tensor`` has exactly the ``expected`` shape."""
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{name} must have shape {layout} = {list(expected)} {context}; got {list(tensor.shape)}"
        )


def require_rank(name: str, tensor: torch.Tensor, layout: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` has as many dimensions as ``layout`` names."""
    rank = layout.count(",") + 1
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}; got shape {list(tensor.shape)}")


def check_groups(nheads: int, ngroups: int, b_shape: torch.Size) -> None:
    """Raise ``ValueError`` unless the heads split evenly over the B/C groups."""
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(
            f"nheads ({nheads}) must be a multiple of ngroups ({ngroups}, from B of shape {list(b_shape)})"
        )


def check_sequence_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> SSDDims:
    """Validate the inputs of a whole-sequence SSD call and return its sizes."""
    require_rank("x", x, "[batch, seqlen, nheads, headdim]")
    batch, seqlen, nheads, headdim = x.shape
    if seqlen < 1:
        raise ValueError(f"x must hold at least one token (seqlen >= 1); got shape {list(x.shape)}")
    context = f"to match x of shape {list(x.shape)}"
    require_rank("B", B, "[batch, seqlen, ngroups, dstate]")
    ngroups, dstate = B.shape[2], B.shape[3]
    require_shape("dt", dt, (batch, seqlen, nheads), "[batch, seqlen, nheads]", context)
    require_shape("A", A, (nheads,), "[nheads]", context)
    require_shape("B", B, (batch, seqlen, ngroups, dstate), "[batch, seqlen, ngroups, dstate]", context)
    require_shape("C", C, (batch, seqlen, ngroups, dstate), "[batch, seqlen, ngroups, dstate]", "to match B")
    check_groups(nheads, ngroups, B.shape)
    if D is not None:
        require_shape("D", D, (nheads,), "[nheads]", context)
    if initial_state is not None:
        require_shape(
            "initial_state",
            initial_state,
            (batch, nheads, headdim, dstate),
            "[batch, nheads, headdim, dstate]",
            f"to match x of shape {list(x.shape)} and B of shape {list(B.shape)}",
        )
    return SSDDims(batch=batch, nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype to compute in: float32, or wider if any given tensor is wider."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype
