"""Prompts (texts or token ids) as token ids, checked."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any


def prompt_token_ids(prompts: object, tokenizer: Any | None) -> list[list[int]]:
    """The token ids of each prompt: a list of texts (encoded by ``tokenizer``) and/or token-id
    lists. ``TypeError``/``ValueError`` naming the prompt's index when one is malformed or empty,
    or is text with no ``tokenizer``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts: must be a list of prompts (wrap a single one in a list), got {type(prompts).__name__}"
        )
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
        raise TypeError("prompts: got one list of token ids; wrap it in a list")
    return [_ids(prompt, index, tokenizer) for index, prompt in enumerate(prompts)]


def _ids(prompt: object, index: int, tokenizer: Any | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompts[{index}]: a text prompt needs a handle with a tokenizer")
        prompt = tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"prompts[{index}]: must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    ids = list(prompt)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise TypeError(f"prompts[{index}]: token ids must be ints >= 0, got {ids[:8]!r:.100}")
    if not ids:
        raise ValueError(f"prompts[{index}]: must hold at least one token")
    return [int(t) for t in ids]
