"""When a request that just got a token is done, and why."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .request import Request


def stop_reason(request: Request, token: int, eos_token_ids: Collection[int], tokenizer: Any) -> str | None:
    """Why ``request`` ends with ``token`` (already appended), or ``None`` if it goes on:
    ``"stop_token"``, ``"eos"`` (unless ``ignore_eos``), ``"stop_string"`` (its text cut before
    the first stop string, decoded by ``tokenizer``), or ``"length"``."""
    params = request.sampling_params
    if token in params.stop_token_ids:
        return "stop_token"
    if not params.ignore_eos and token in eos_token_ids:
        return "eos"
    if params.stop_strings:
        text = tokenizer.decode(request.generated_tokens)
        cuts = [text.find(s) for s in params.stop_strings if s in text]
        if cuts:
            request.generated_text = text[: min(cuts)]
            return "stop_string"
    if len(request.tokens) >= params.max_total_length(len(request.prompt_tokens)):
        return "length"
    return None
