"""Cross entropy of one chunk of float32 logits as Triton kernels, with ``cross_entropy_reference``'s
interface: one program per row, read in blocks of at most ``MAX_BLOCK`` columns. The statistics
kernel takes the row's maximum and sum of exponentials in one pass (rescaled block by block), its
target logit and sum of logits; with a tensor-parallel group the ranks' maxima are all-reduced and
each rank's sum rescaled to the global maximum before the sums are all-reduced. The gradient
kernel writes ``scale * (exp(x - lse) - a / V - (1 - a) onehot)`` over the chunk in place.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .cross_entropy_reference import ChunkTargets, Smoothing

MAX_BLOCK = 4096


@triton.jit
def _statistics_kernel(
    x_ptr,
    target_ptr,
    here_ptr,
    max_ptr,
    sum_exp_ptr,
    picked_ptr,
    x_sum_ptr,
    n_cols,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.full([], 0.0, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        z = z * tl.exp(m - m_new) + tl.sum(tl.where(inside, tl.exp(x - m_new), 0.0), axis=0)
        total += tl.sum(tl.where(inside, x, 0.0), axis=0)
        m = m_new
    here = tl.load(here_ptr + row) != 0
    target = tl.load(target_ptr + row)
    picked = tl.load(x_ptr + row * n_cols + target, mask=here, other=0.0)
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, z)
    tl.store(picked_ptr + row, tl.where(here, picked, 0.0))
    tl.store(x_sum_ptr + row, total)


@triton.jit
def _gradient_kernel(
    x_ptr,
    lse_ptr,
    scale_ptr,
    target_ptr,
    here_ptr,
    n_cols,
    uniform,
    on_target,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.where(tl.load(here_ptr + row) != 0, tl.load(target_ptr + row), -1)
    for block in range(BLOCKS):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        grad = tl.exp(x - lse) - uniform - tl.where(cols == target, on_target, 0.0)
        tl.store(x_ptr + offsets, grad * scale, mask=inside)


def _block(n_cols: int) -> tuple[int, int]:
    """``(BLOCK, BLOCKS)``: columns per loop step and the compile-time step count (Triton 3.2's
    interpreter cannot loop to a run-time bound with numpy 2.4)."""
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    return block, triton.cdiv(n_cols, block)


def _statistics(logits: torch.Tensor, targets: ChunkTargets) -> torch.Tensor:
    """``[4, r]`` float32: each row's maximum, sum of ``exp(x - max)``, target logit, sum of logits."""
    rows, vocab = logits.shape
    stats = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    block, blocks = _block(vocab)
    _statistics_kernel[(rows,)](
        logits,
        targets.local,
        targets.here.to(torch.int8),
        *stats,
        vocab,
        BLOCK=block,
        BLOCKS=blocks,
    )
    return stats


def _global(stats: torch.Tensor, here: torch.Tensor, group: dist.ProcessGroup | None):
    """``(row_max, sum_exp, target_logit, found, logit_sum)`` over all ranks' shards."""
    row_max, sum_exp, picked, logit_sum = stats
    found = here.to(torch.float32)
    if group is None:
        return row_max, sum_exp, picked, found, logit_sum
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.where(sum_exp > 0, sum_exp * torch.exp(row_max - global_max), 0.0)
    sums = torch.stack([sum_exp, picked, found, logit_sum])
    dist.all_reduce(sums, group=group)
    return global_max, *sums


def chunk_forward_(
    logits: torch.Tensor,
    targets: ChunkTargets,
    group: dist.ProcessGroup | None,
    smoothing: Smoothing,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cross_entropy_reference.chunk_forward_`` by the Triton kernels."""
    rows, vocab = logits.shape
    if vocab:
        stats = _statistics(logits, targets)
    else:  # a rank holding only padded ids: nothing to add
        stats = torch.zeros(4, rows, dtype=torch.float32, device=logits.device)
        stats[0] = float("-inf")
    row_max, sum_exp, target_logit, found, logit_sum = _global(stats, targets.here, group)
    lse = sum_exp.log() + row_max
    loss = lse - (1.0 - smoothing.a) * target_logit
    if smoothing.a:
        loss = loss - (smoothing.a / smoothing.vocab) * logit_sum
    if want_grad:
        chunk_gradient_(logits, lse, targets, targets.valid.to(torch.float32), smoothing)
    return loss, lse, found


def chunk_gradient_(
    logits: torch.Tensor, lse: torch.Tensor, targets: ChunkTargets, scale: torch.Tensor, smoothing: Smoothing
) -> torch.Tensor:
    """``cross_entropy_reference.chunk_gradient_`` by the Triton kernel."""
    rows, vocab = logits.shape
    if not (rows and vocab):
        return logits
    block, blocks = _block(vocab)
    uniform = smoothing.a / smoothing.vocab if smoothing.a else 0.0
    _gradient_kernel[(rows,)](
        logits,
        lse.contiguous(),
        scale.to(torch.float32).contiguous(),
        targets.local,
        targets.here.to(torch.int8),
        vocab,
        uniform,
        1.0 - smoothing.a,
        BLOCK=block,
        BLOCKS=blocks,
    )
    return logits
