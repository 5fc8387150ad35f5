"""The errors of the inference handles: each names what is wrong and where."""

from __future__ import annotations

from mcore_api import experimental_api


@experimental_api
class VocabularyMismatchError(ValueError):
    """The tokenizer has ids the model has no embedding row for: refused when the handle is built."""


@experimental_api
class EndpointUnavailableError(ConnectionError):
    """An HTTP inference endpoint cannot be reached or did not answer; the message names its URL."""


@experimental_api
class GenerationError(RuntimeError):
    """The backend refused or failed a prompt (bad input, or an error on its side); the message
    names the prompt's index (and the URL, for an HTTP endpoint) and the backend's reason."""
