"""Comparing gradients (or any tensors) with a reference, with an error bound that depends on depth and dtype."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ..device import get_group_device

DEFAULT_BOUND_FACTOR = 8.0


@experimental_api
def relative_difference(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference||_F / ||reference||_F`` in float64 (the absolute norm when the reference is 0)."""
    if actual.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(reference.shape)}")
    actual, reference = actual.detach().double(), reference.detach().double()
    difference = torch.linalg.vector_norm(actual - reference).item()
    scale = torch.linalg.vector_norm(reference).item()
    return difference / scale if scale > 0 else difference


@experimental_api
def sharded_frobenius_norm(
    local_shards: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> float:
    """The Frobenius norm of tensors of which each rank of ``group`` holds disjoint shards (collective).

    Pass each rank's shards only; replicated tensors would be counted once per rank.
    """
    squares = torch.zeros((), dtype=torch.float64, device=get_group_device(group))
    for shard in local_shards:
        squares += torch.linalg.vector_norm(shard.detach().double()).to(squares.device) ** 2
    dist.all_reduce(squares, group=group)
    return math.sqrt(squares.item())


@experimental_api
def expected_error_bound(dtype: torch.dtype, depth: int, factor: float = DEFAULT_BOUND_FACTOR) -> float:
    """Relative error to expect between two computations that differ only in summation order.

    ``factor * eps(dtype) * depth``: rounding errors of each of ``depth`` layers add up along the
    chain of matmuls (forward and back), and ``factor`` covers reduction lengths and splits.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return factor * torch.finfo(dtype).eps * depth


@experimental_api
@dataclass(frozen=True)
class GradientCheck:
    """The outcome of ``check_gradient``: relative ``error``, the ``bound`` it was held to, and ``ok``."""

    error: float
    bound: float
    ok: bool


@experimental_api
def check_gradient(
    actual: torch.Tensor,
    reference: torch.Tensor,
    depth: int,
    dtype: torch.dtype | None = None,
    factor: float = DEFAULT_BOUND_FACTOR,
) -> GradientCheck:
    """Compare ``actual`` with ``reference`` against ``expected_error_bound`` (dtype: ``actual``'s)."""
    error = relative_difference(actual, reference)
    bound = expected_error_bound(dtype or actual.dtype, depth, factor)
    return GradientCheck(error, bound, error <= bound)
