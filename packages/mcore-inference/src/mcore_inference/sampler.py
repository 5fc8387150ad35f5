"""Sampling the next token of each request in a batch, each with its own parameters, in batched
tensor ops on the logits' device.

One step: the per-row parameters go to the device as one small table; penalties (only if a row
asks) change the logits; one ``argmax`` gives every greedy row's token; the sampled rows are
filtered together (temperature, then ``top_k``/``top_p``/``min_p``, sorting only if a row uses
``top_k`` or ``top_p``) and each draws by inverting its filtered distribution's cumulative sum at
one uniform number. A seeded row's number is a hash of (seed, how many tokens it generated), so it
does not depend on what the row is batched with; the other rows' numbers are one draw from the
engine's generator. Log-probabilities are computed only for the rows that ask for them. The host
reads the tokens back once (and the log-probabilities once, if asked).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mcore_api import internal_api

from .host_tensor import host_tensor
from .penalties import apply_penalties, token_counts
from .sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


UNSAMPLEABLE = -1
"""The token ``sample`` returns for a row whose distribution is not valid."""


@internal_api
@dataclass
class SampledTokens:
    """The sampled token of each row, its log-probability and the top-n log-probabilities
    (both under the model's distribution before penalties and temperature; ``nan`` and ``{}``
    for a row that asked for neither ``logprobs`` nor ``top_n_logprobs``). A row with no valid
    distribution to draw from gets the token ``UNSAMPLEABLE``."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


def _mix32(x: int) -> int:
    """A 32-bit bijective integer hash (C. Wellons' ``lowbias32``) of ``x`` in ``[0, 2**32)``."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=1 << 14)
def _seed_state(seed: int) -> int:
    """The hash state after ``seed`` (the part of a draw that is the same at every position)."""
    return _mix32(_mix32((seed & _MASK32) ^ 0x9E3779B9) ^ (seed >> 32))


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in ``[0, 1)`` for ``(seed, position)`` (ints in ``[0, 2**63)``): a pure
    function of the pair, so the same on every device and in every batch. Its 53 bits are exact
    in float64. Computed on Python ints, a few microseconds a row: the same hash as a batch of
    tensor ops takes ~75 ops of several microseconds each, whatever the batch."""
    h = _mix32(_seed_state(seed) ^ (position & _MASK32))
    high = _mix32(h ^ 0x85EBCA6B)
    low = _mix32(high ^ 0xC2B2AE35)
    return ((high >> 5) * 2**26 + (low >> 6)) / 2**53


def _uniforms(
    params: Sequence[SamplingParams], positions: Sequence[int], generator: torch.Generator | None
) -> list[float]:
    """One uniform number per row: seeded rows hash (seed, position), the others share one
    draw (float64) from ``generator``."""
    unseeded = sum(p.seed is None for p in params)
    draws = iter(torch.rand(unseeded, dtype=torch.float64, generator=generator).tolist() if unseeded else ())
    return [
        next(draws) if p.seed is None else seeded_uniform(p.seed, position)
        for p, position in zip(params, positions, strict=True)
    ]


def _filter(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, sort: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scaled [r, V]`` (already divided by temperature) with the tokens that ``top_k [r, 1]``
    (vocabulary size = off), ``top_p`` and ``min_p`` exclude set to ``-inf``: sorted in descending
    order, with the sort's ``order``, when ``sort`` (needed for ``top_k``/``top_p``); in vocabulary
    order, with ``None``, otherwise (``min_p`` needs only the maximum)."""
    if not sort:
        probs = torch.softmax(scaled, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        return scaled.masked_fill(remove, float("-inf")), None
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    remove = ranks >= top_k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays
    remove |= (mass_before >= top_p) & (top_p < 1)  # 1 = off, even where float sums reach 1 early
    remove |= probs < min_p * probs[:, :1]
    return sorted_logits.masked_fill(remove, float("-inf")), order


def _draw(filtered: torch.Tensor, order: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Token id of each row of ``filtered [r, V]`` (``-inf`` = excluded; ``order`` maps columns
    to token ids, ``None`` = identity) at the quantile ``uniforms [r]`` of its distribution."""
    cdf = torch.softmax(filtered, dim=-1).cumsum(dim=-1, dtype=torch.float64)
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    column = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    most_likely = filtered.argmax(dim=-1)  # where rounding puts the target at the very end
    column = torch.where(column < filtered.shape[-1], column, most_likely)
    if order is None:
        return column
    return order.gather(1, column.unsqueeze(1)).squeeze(1)


@internal_api
def nonfinite_rows(values: torch.Tensor) -> torch.Tensor:
    """``[R]``: the rows of ``values [R, V]`` that no token can be drawn from: a NaN, a ``+inf``, or
    every entry ``-inf`` (single ``-inf`` entries are excluded tokens and fine). Exactly the rows
    whose maximum is not finite, as max reductions propagate NaN: one pass over the values."""
    return ~torch.isfinite(values.amax(dim=-1))


def _rows(mask: list[bool], device: torch.device) -> slice | torch.Tensor:
    """Index of the rows where ``mask`` holds: a slice when it is all of them."""
    if all(mask):
        return slice(None)
    return host_tensor([i for i, m in enumerate(mask) if m]).to(device)


def _parameter_columns(
    params: Sequence[SamplingParams],
    vocab: int,
    outputs: Sequence[Sequence[int]],
    generator: torch.Generator | None,
    with_uniforms: bool,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Per-row ``[R]`` tensors on ``device``, copied there in one transfer: temperature (1 for
    greedy rows), top_k (vocabulary size = off), top_p, min_p, the presence, frequency and
    repetition penalties, and (float64) the uniform numbers of the draws if ``with_uniforms``."""
    uniforms = _uniforms(params, [len(o) for o in outputs], generator) if with_uniforms else None
    values: list[float] = []
    for i, p in enumerate(params):
        values += (
            p.temperature if p.temperature > 0 else 1.0,
            p.top_k or vocab,
            p.top_p,
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        if uniforms is not None:
            values.append(uniforms[i])
    table = host_tensor(values, torch.float64).view(len(params), 8 if with_uniforms else 7)
    table = table.to(device, non_blocking=True)
    return (*table[:, :7].float().unbind(1), *table[:, 7:].unbind(1))


@internal_api
def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [R, V]`` divided by each row's temperature, with the tokens that its ``top_k``,
    ``top_p`` and ``min_p`` exclude set to ``-inf`` (rows must not be greedy)."""
    vocab = logits.shape[-1]
    table = torch.tensor(
        [(p.temperature, p.top_k or vocab, p.top_p, p.min_p) for p in params], dtype=torch.float64
    ).to(logits.device)
    temperature, top_k, top_p, min_p = (column.unsqueeze(1) for column in table.float().unbind(1))
    scaled = logits.float() / temperature
    filtered, order = _filter(scaled, top_k, top_p, min_p, sort=True)
    return torch.full_like(scaled, float("-inf")).scatter(1, order, filtered)


@internal_api
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generator: torch.Generator | None = None,
    *,
    prompt_tokens: Sequence[Sequence[int]] | None = None,
    output_tokens: Sequence[Sequence[int]] | None = None,
) -> SampledTokens:
    """Next token of each row of ``logits [R, V]``, in batched ops on ``logits``' device.

    Penalties first (``output_tokens``, the tokens each row generated so far, and
    ``prompt_tokens`` are needed only by rows with penalties), then the argmax for
    ``temperature == 0``, else a draw from the filtered distribution. A row with a ``seed`` draws
    the same token for the same logits and ``len(output_tokens[i])`` whatever its batch; the
    other rows take one batched draw from ``generator`` (CPU; default: torch's global one).
    """
    device, vocab, count = logits.device, logits.shape[-1], len(params)
    raw = logits.float()
    outputs = output_tokens if output_tokens is not None else [()] * count
    sampled = [not p.greedy for p in params]
    penalised = [p.has_penalties for p in params]
    scored = raw
    if any(sampled) or any(penalised):
        columns = _parameter_columns(params, vocab, outputs, generator, any(sampled), device)
    if any(penalised):
        rows = _rows(penalised, device)
        chosen = [i for i, m in enumerate(penalised) if m]
        prompts = prompt_tokens if prompt_tokens is not None else [()] * count
        counts = token_counts([outputs[i] for i in chosen], vocab, device)
        repeats = [prompts[i] if params[i].repetition_penalty != 1.0 else () for i in chosen]
        prompt_mask = token_counts(repeats, vocab, device) > 0
        presence, frequency, repetition = (columns[c][rows] for c in (4, 5, 6))
        scored = raw.clone()
        scored[rows] = apply_penalties(raw[rows], counts, prompt_mask, presence, frequency, repetition)

    if any(sampled):
        rows = _rows(sampled, device)
        temperature, top_k, top_p, min_p = (columns[c][rows].unsqueeze(1) for c in range(4))
        sort = any(p.top_k or p.top_p < 1.0 for p, s in zip(params, sampled, strict=True) if s)
        scaled = scored[rows] / temperature
        filtered, order = _filter(scaled, top_k, top_p, min_p, sort)
        drawn = _draw(filtered, order, columns[7][rows]).masked_fill(nonfinite_rows(scaled), UNSAMPLEABLE)
        # the greedy rows' tokens are the argmax; an all-sampled batch needs none
        tokens = _argmax_rows(scored).index_copy(0, rows, drawn) if isinstance(rows, torch.Tensor) else drawn
    else:
        tokens = _argmax_rows(scored)

    token_list = tokens.tolist()
    logprobs, top_logprobs = _logprobs(raw, tokens, params)
    return SampledTokens(token_list, logprobs, top_logprobs)


_ARGMAX_BLOCK = 128


def _argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """``values.argmax(dim=-1)`` of ``[R, V]``, the same indices (first of ties, first NaN), in
    two vectorised passes: the maximum of each block of ``_ARGMAX_BLOCK`` columns, then the
    argmax inside the first block holding the row's maximum. On the CPU ``argmax`` over a
    vocabulary is a scalar loop, ten times slower than ``amax``."""
    rows, width = values.shape
    blocks = width // _ARGMAX_BLOCK
    if blocks < 2:
        return values.argmax(dim=-1)
    body = values[:, : blocks * _ARGMAX_BLOCK].reshape(rows, blocks, _ARGMAX_BLOCK).amax(dim=-1)
    if width > blocks * _ARGMAX_BLOCK:  # the tail is one more (shorter) block
        body = torch.cat([body, values[:, blocks * _ARGMAX_BLOCK :].amax(dim=-1, keepdim=True)], dim=1)
    start = body.argmax(dim=-1, keepdim=True) * _ARGMAX_BLOCK
    columns = (start + torch.arange(_ARGMAX_BLOCK, device=values.device)).clamp_(max=width - 1)
    return start.squeeze(1) + values.gather(1, columns).argmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[list[float], list[dict[int, float]]]:
    """The chosen tokens' and the top-n log-probabilities of the rows that ask for them, from one
    ``log_softmax`` over those rows only."""
    asking = [p.logprobs or p.top_n_logprobs > 0 for p in params]
    chosen: list[float] = [float("nan")] * len(params)
    top: list[dict[int, float]] = [{} for _ in params]
    if not any(asking):
        return chosen, top
    indices = [i for i, a in enumerate(asking) if a]
    rows = _rows(asking, logits.device)
    logprobs = torch.log_softmax(logits[rows], dim=-1)
    values = logprobs.gather(1, tokens[rows].clamp(min=0).unsqueeze(1)).squeeze(1).tolist()
    for i, value in zip(indices, values, strict=True):
        chosen[i] = value
    widest = max(params[i].top_n_logprobs for i in indices)
    if widest:
        best = logprobs.topk(widest, dim=-1)
        for i, ids, lps in zip(indices, best.indices.tolist(), best.values.tolist(), strict=True):
            n = params[i].top_n_logprobs
            if n:
                top[i] = dict(zip(ids[:n], lps[:n], strict=True))
    return chosen, top
