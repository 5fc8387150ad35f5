"""What an inference handle returns, and the protocol every handle implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mcore_api import experimental_api

Prompt = str | Sequence[int]
"""A prompt: text (encoded by the handle's tokenizer) or token ids."""


@experimental_api
@dataclass(frozen=True)
class Generation:
    """One sampled completion of one prompt.

    ``prompt_ids`` / ``completion_ids``: the token ids the model saw and sampled (an end-of-sequence
    token that ended the completion is included; behind an HTTP endpoint, where the server lists
    it in ``logprobs``, as ``mcore-serve`` and vLLM do); ``text``: the completion's text, cut
    before a stop string (``None`` for a handle without a tokenizer; ``EngineHandle`` and
    ``HFHandle`` decode the end-of-sequence token into it, an HTTP server leaves it out); ``logprobs``: one float per completion token, the
    log-probability of that token under the model's distribution at the step that sampled it,
    before temperature and top-k/top-p filtering (as vLLM and the mcore engine report it);
    ``finish_reason``: ``"stop"`` (end-of-sequence token or stop string) or ``"length"``
    (``max_tokens`` reached); ``prompt_index`` / ``sample_index``: which prompt of the call and
    which of its ``n`` samples this is.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str | None
    logprobs: list[float]
    finish_reason: str
    prompt_index: int
    sample_index: int


@experimental_api
class InferenceHandle(Protocol):
    """What agents need of an inference backend: ``generate(prompts, **sampling)`` returns
    ``len(prompts) * n`` ``Generation`` s, prompt by prompt, the ``n`` samples of each together.
    ``sampling`` are the fields of ``SamplingOptions``."""

    def generate(self, prompts: Sequence[Prompt], **sampling: Any) -> list[Generation]: ...
