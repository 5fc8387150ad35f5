"""Presence, frequency and repetition penalties on a batch of logits, as vLLM and OpenAI apply them."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from .host_tensor import host_tensor


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` float counts of each token id in each list, built with one
    copy of the concatenated ids to ``device`` and one ``index_add_`` (no per-row op)."""
    counts = torch.zeros(len(token_lists) * vocab_size, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths):
        ids = host_tensor(chain.from_iterable(token_lists))
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), host_tensor(lengths))
        flat = (rows * vocab_size + ids).to(device, non_blocking=True)
        counts.index_add_(0, flat, torch.ones(flat.shape, device=device))
    return counts.view(len(token_lists), vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised ``logits [R, V]`` (float), in vLLM's order.

    ``repetition [R]`` (1 = off) divides the positive and multiplies the negative logits of every
    token in the prompt (``prompt_mask [R, V]``) or the output so far; then ``frequency [R]`` times
    each token's count in the output (``output_counts [R, V]``) and ``presence [R]`` for each token
    the output holds at all are subtracted. The prompt counts only for the repetition penalty.
    """
    in_output = output_counts > 0
    factor = torch.where(in_output | prompt_mask, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * in_output
