"""The check that a tokenizer fits the model a handle samples from."""

from __future__ import annotations

from typing import Any

from mcore_api import experimental_api

from .errors import VocabularyMismatchError


def tokenizer_size(tokenizer: Any) -> int:
    """How many ids ``tokenizer`` can produce: ``len(tokenizer)`` (a Hugging Face tokenizer,
    added tokens included) or its ``vocab_size`` (an ``mcore_models.data.Tokenizer``)."""
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int):
        raise TypeError(f"tokenizer: {type(tokenizer).__name__} has neither __len__ nor an int vocab_size")
    return size


@experimental_api
def check_vocabulary(tokenizer: Any, model_vocab_size: int, model_name: str = "the model") -> None:
    """Refuse a ``tokenizer`` with more ids than ``model_vocab_size`` (the model's embedding rows):
    ``VocabularyMismatchError`` naming both sizes. A smaller tokenizer is fine (padded vocabularies)."""
    size = tokenizer_size(tokenizer)
    if size > model_vocab_size:
        raise VocabularyMismatchError(
            f"the tokenizer ({type(tokenizer).__name__}) has {size} ids but {model_name} has "
            f"{model_vocab_size} embedding rows: ids >= {model_vocab_size} would index past them; "
            "use the tokenizer the model was trained with"
        )
