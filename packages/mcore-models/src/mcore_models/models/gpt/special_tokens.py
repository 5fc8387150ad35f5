"""Checks for the special token ids a model carries (begin/end of sequence, padding)."""

from __future__ import annotations


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_id(field: str, value: object) -> int | None:
    """``value`` if it is ``None`` or an int >= 0; else ``ValueError`` naming ``field``."""
    if value is None or _is_token_id(value):
        return value
    raise ValueError(f"{field} must be a token id (an int >= 0) or None, got {value!r}")


def token_ids(field: str, value: object) -> tuple[int, ...]:
    """``value`` (one id, a list or tuple of ids, or ``None`` for none) as a tuple of ids."""
    values = () if value is None else value if isinstance(value, (list, tuple)) else (value,)
    if not all(_is_token_id(v) for v in values):
        raise ValueError(f"{field} must be a token id, a list of token ids or None, got {value!r}")
    return tuple(values)
