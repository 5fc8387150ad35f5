"""What the cross-entropy entry points share: checks of their options and targets (errors naming
the argument), the targets as a vocabulary shard sees them, and the reduction of per-token losses."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from . import cross_entropy_reference
from .cross_entropy_reference import ChunkTargets, Smoothing

REDUCTIONS = ("none", "sum", "mean")
# Rows per chunk: enough for an efficient matmul, and about 16 MiB of float32 logits when the
# vocabulary is small enough for that to hold more rows.
_MIN_CHUNK_ROWS = 256
_CHUNK_ELEMENTS = 1 << 22


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk for a (local) vocabulary of ``vocab`` columns."""
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // max(vocab, 1))


def chunk_kernels(backend: str):
    """The module with ``chunk_forward_`` and ``chunk_gradient_`` for ``backend``."""
    if backend == "reference":
        return cross_entropy_reference
    return importlib.import_module("mcore_kernels.cross_entropy_triton")


def check_options(op: str, reduction, label_smoothing, chunk_size, vocab_start) -> None:
    """Raise ``ValueError`` naming the first option out of its range."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not (0.0 <= label_smoothing < 1.0)
    ):
        raise ValueError(f"{op}: label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"{op}: vocab_start must be an int >= 0, got {vocab_start!r}")


def check_target_tensor(op: str, target, shape: torch.Size, device: torch.device) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``target`` is int64 or int32 of ``shape`` on ``device``."""
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        kind = str(target.dtype) if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"{op}: target must be an int64 or int32 tensor, got {kind}")
    if target.shape != shape or target.device != device:
        raise ValueError(
            f"{op}: target must have shape {tuple(shape)} on {device}, got {tuple(target.shape)} on {target.device}"
        )


def shard_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or ``None`` where it has one rank (the whole vocabulary is here)."""
    if group is not None and dist.get_world_size(group) == 1:
        return None
    return group


def smoothing_over(label_smoothing: float, vocab: int, group, device: torch.device) -> Smoothing:
    """``label_smoothing`` over the classes of all shards (all-reduced only where it is not 0)."""
    if group is None or not label_smoothing:
        return Smoothing(float(label_smoothing), vocab)
    total = torch.tensor([vocab], device=device)
    dist.all_reduce(total, group=group)
    return Smoothing(float(label_smoothing), int(total.item()))


def counted_targets(target: torch.Tensor, ignore_index: int, vocab_start: int, vocab: int) -> ChunkTargets:
    """The targets ``[n]`` as the shard of ``vocab`` classes from ``vocab_start`` sees them."""
    valid = target != ignore_index
    local = target.long() - vocab_start
    here = valid & (local >= 0) & (local < vocab)
    return ChunkTargets(local.masked_fill(~here, 0).unsqueeze(1), here, valid)


def check_targets(
    op: str, target: torch.Tensor, valid: torch.Tensor, found: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """Raise ``ValueError`` naming a counted target that not exactly one shard holds."""
    bad = valid & (found != 1)
    if not bad.any():
        return
    value = target[bad][0].item()
    where = "in the vocabulary" if group is None else "in exactly one rank's vocabulary shard"
    raise ValueError(f"{op}: target {value} is not {where} (nor ignore_index)")


def reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token ``loss`` as is, summed, or averaged over the counted tokens (NaN with none, as
    ``torch.nn.functional.cross_entropy``)."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
