"""Special token ids (bos, eos, pad) between a Hugging Face checkpoint's config files and ``GPTModel``."""

from __future__ import annotations

from typing import Any

from ..models.gpt.model import GPTModel
from ..models.gpt.special_tokens import token_id, token_ids

KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_tokens_from_hf(
    hf_config: dict[str, Any], generation_config: dict[str, Any], defaults: dict[str, Any]
) -> dict[str, Any]:
    """``GPTModel``'s ``bos_token_id``, ``eos_token_ids`` and ``pad_token_id``.

    Each id comes from ``generation_config.json`` when it names it (what ``generate`` uses),
    else from ``config.json``, else from the family's default (what ``transformers`` assumes
    when ``config.json`` omits it). ``eos_token_id`` may be one id or a list. A value that is not
    a token id raises ``ValueError`` naming the file and the key.
    """
    sources = {
        "generation_config.json": generation_config,
        "config.json": hf_config,
        "the family default": defaults,
    }
    found = {}
    for key in KEYS:
        origin = next((name for name, source in sources.items() if key in source), None)
        found[key] = (f"{origin} {key}", sources[origin][key]) if origin is not None else (key, None)
    return {
        "bos_token_id": token_id(*found["bos_token_id"]),
        "eos_token_ids": token_ids(*found["eos_token_id"]),
        "pad_token_id": token_id(*found["pad_token_id"]),
    }


def special_tokens_to_hf(model: GPTModel) -> dict[str, Any]:
    """The ``KEYS`` entries of ``config.json`` and ``generation_config.json`` for ``model``
    (``eos_token_id`` an int when the model has one, a list when several, ``None`` when none)."""
    eos = list(model.eos_token_ids)
    return {
        "bos_token_id": model.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": model.pad_token_id,
    }
