"""Sampling the next token of each request in a batch, each with its own parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mcore_api import internal_api

from .sampling_params import SamplingParams


@internal_api
@dataclass
class SampledTokens:
    """The sampled token of each row, its log-probability and the top-n log-probabilities
    (both under the model's distribution before temperature)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


@internal_api
def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [R, V]`` divided by each row's temperature, with the tokens that its ``top_k``,
    ``top_p`` and ``min_p`` exclude set to ``-inf`` (rows must not be greedy)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=device)
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device).unsqueeze(1)
    remove = ranks >= top_k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays
    remove |= mass_before >= top_p
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    remove |= probs < min_p * probs[:, :1]
    filtered = torch.full_like(scaled, float("-inf"))
    return filtered.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))


@internal_api
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> SampledTokens:
    """Next token of each row of ``logits [R, V]``: the argmax for ``temperature == 0``, else a
    draw from the filtered distribution with that row's generator."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = torch.softmax(filter_logits(logits[rows], [params[i] for i in sampled_rows]), dim=-1).cpu()
        for j, i in enumerate(sampled_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i]).item()
    token_list = tokens.tolist()
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_logprobs: list[dict[int, float]] = []
    for i, p in enumerate(params):
        if p.top_n_logprobs:
            values, indices = logprobs[i].topk(p.top_n_logprobs)
            top_logprobs.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
        else:
            top_logprobs.append({})
    return SampledTokens(token_list, chosen, top_logprobs)
