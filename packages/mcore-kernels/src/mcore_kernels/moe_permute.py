"""``moe_permute`` and ``moe_unpermute``: the public entry points, autograd functions over the
Triton (CUDA) or native C++ (CPU) kernels (``dispatch``; the reference is differentiated by
autograd), and the checks that turn bad arguments into errors naming them."""

from __future__ import annotations

import importlib

import torch

from . import moe_permute_native, moe_permute_reference
from .dispatch import select_elementwise_backend


def _kernels(backend: str):
    """The module with ``scatter`` and ``gather`` of ``backend`` ("triton" or "native")."""
    if backend == "native":
        return moe_permute_native
    return importlib.import_module("mcore_kernels.moe_permute_triton")


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, row_map, num_rows, backend):
        ctx.save_for_backward(row_map)
        ctx.backend = backend
        return _kernels(backend).scatter(hidden.contiguous(), row_map, None, num_rows)[0]

    @staticmethod
    def backward(ctx, dout):
        (row_map,) = ctx.saved_tensors
        return _kernels(ctx.backend).gather(dout.contiguous(), row_map, None), None, None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_map, probs, backend):
        rows = rows.contiguous()
        weights = None if probs is None else probs.contiguous()
        ctx.save_for_backward(rows, row_map, weights)
        ctx.probs_dtype = None if probs is None else probs.dtype
        ctx.backend = backend
        return _kernels(backend).gather(rows, row_map, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, row_map, weights = ctx.saved_tensors
        other = None if weights is None or not ctx.needs_input_grad[2] else rows
        drows, dots = _kernels(ctx.backend).scatter(dout.contiguous(), row_map, weights, rows.shape[0], other)
        dprobs = None if dots is None else dots.to(ctx.probs_dtype)
        return drows, None, dprobs, None


def _check_row_map(op: str, row_map, tokens: int | None) -> None:
    if (
        not isinstance(row_map, torch.Tensor)
        or row_map.dtype != torch.int64
        or row_map.dim() != 2
        or (tokens is not None and row_map.shape[0] != tokens)
    ):
        kind = (
            f"{row_map.dtype} {tuple(row_map.shape)}" if isinstance(row_map, torch.Tensor) else type(row_map)
        )
        want = "[T, k]" if tokens is None else f"[T={tokens}, k]"
        raise ValueError(f"{op}: row_map must be an int64 {want} tensor, got {kind}")


def _check_matrix(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 2:
        kind = (
            f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        )
        raise TypeError(f"{op}: {name} must be a floating-point [rows, h] tensor, got {kind}")


def moe_permute(hidden: torch.Tensor, row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, h]``: a copy of token ``t``'s ``hidden [T, h]`` in row ``row_map[t, j]`` for
    each assignment ``j`` (int64 ``[T, k]``; ``-1``: dropped), zeros in the rows no assignment
    names. Rows must be distinct and below ``num_rows`` (a ``ValueError`` on the CPU; not checked
    on CUDA: that would wait on the device). Differentiable in ``hidden``."""
    _check_matrix("moe_permute", "hidden", hidden)
    _check_row_map("moe_permute", row_map, hidden.shape[0])
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"moe_permute: num_rows must be a non-negative int, got {num_rows!r}")
    if row_map.device != hidden.device:
        raise ValueError(f"moe_permute: row_map must be on {hidden.device}, got {row_map.device}")
    backend = select_elementwise_backend("moe_permute", hidden)
    if backend == "reference":
        return moe_permute_reference.moe_permute(hidden, row_map, num_rows)
    return _PermuteFunction.apply(hidden, row_map.contiguous(), num_rows, backend)


def moe_unpermute(
    rows: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """``[T, h]``: each token's sum of the ``rows [R, h]`` its kept assignments name in
    ``row_map [T, k]`` (as in ``moe_permute``), weighted by ``probs [T, k]`` (``None``: unweighted);
    a token with no kept assignment gets zeros. Rows must be below ``R`` (a ``ValueError`` on the
    CPU; not checked on CUDA). Differentiable in ``rows`` and ``probs``."""
    _check_matrix("moe_unpermute", "rows", rows)
    _check_row_map("moe_unpermute", row_map, None)
    if probs is not None and (
        not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.shape != row_map.shape
    ):
        raise ValueError(
            f"moe_unpermute: probs must be a floating-point tensor of row_map's shape {tuple(row_map.shape)}"
        )
    if any(t.device != rows.device for t in (row_map, probs) if t is not None):
        raise ValueError(f"moe_unpermute: row_map and probs must be on {rows.device}")
    backend = select_elementwise_backend("moe_unpermute", rows)
    if backend == "reference":
        return moe_permute_reference.moe_unpermute(rows, row_map, probs)
    return _UnpermuteFunction.apply(rows, row_map.contiguous(), probs, backend)
