"""The embedded default's tokenizer: one id per character of sums, and an end token."""

from __future__ import annotations

from collections.abc import Iterable

from mcore_api import experimental_api

END_TEXT = "\n"
"""How the end token reads as text: a newline, which ends an answer for ``AdditionAgent``."""


@experimental_api
class CharTokenizer:
    """Characters to ids: id 0 is the end token (``eod_id``, also the pad id, written ``"\\n"``),
    then one id per character of ``alphabet`` (default: the digits, ``+`` and ``=``). ``encode``
    raises ``ValueError`` naming a character outside the alphabet; ``decode`` one naming an id
    outside the vocabulary."""

    def __init__(self, alphabet: str = "0123456789+="):
        if not alphabet or len(set(alphabet)) != len(alphabet) or END_TEXT in alphabet:
            raise ValueError(f"alphabet: must be distinct characters without a newline, got {alphabet!r}")
        self.alphabet = alphabet
        self.eod_id = self.pad_id = 0
        self._ids = {ch: i + 1 for i, ch in enumerate(alphabet)} | {END_TEXT: 0}
        self._chars = END_TEXT + alphabet

    @property
    def vocab_size(self) -> int:
        """How many ids: the alphabet and the end token."""
        return len(self._chars)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """The id of each character of ``text``."""
        bad = next((ch for ch in text if ch not in self._ids), None)
        if bad is not None:
            raise ValueError(f"text: {bad!r} is not in the tokenizer's alphabet {self.alphabet!r}")
        return [self._ids[ch] for ch in text]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (the end token as a newline)."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
        return "".join(self._chars[i] for i in ids)
