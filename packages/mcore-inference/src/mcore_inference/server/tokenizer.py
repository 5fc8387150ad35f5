"""What the HTTP server needs of a tokenizer, and an adapter over ``mcore_models.data.Tokenizer``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from mcore_models.data import Tokenizer


@runtime_checkable
class ServingTokenizer(Protocol):
    """Text to token ids and back, the end-of-sequence ids and the vocabulary size."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...


class TokenizerAdapter:
    """A ``ServingTokenizer`` over an ``mcore_models.data.Tokenizer`` (a Hugging Face
    ``tokenizer.json``): ``encode`` adds no special tokens, ``decode`` writes them out, the
    end-of-sequence id is the tokenizer's ``eod_id``."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-document id."""
        return [self.tokenizer.eod_id]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (for log-probabilities)."""
        return self.tokenizer.decode([token_id])


def load_tokenizer(model_dir: str | os.PathLike) -> TokenizerAdapter:
    """The ``tokenizer.json`` of a model directory as a ``ServingTokenizer``; ``FileNotFoundError``
    naming the path when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return TokenizerAdapter(Tokenizer.from_file(path))
