"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Filters apply in this order to the logits divided by ``temperature``: ``top_k`` (0 = off),
    ``top_p`` (1 = off), ``min_p`` (0 = off, relative to the most likely token). ``temperature=0``
    is greedy. ``seed`` makes a request's samples reproducible whatever it is batched with.
    Generation stops after ``num_tokens_to_generate`` tokens, or when prompt + output reaches
    ``num_tokens_total`` (the stricter of both when both are set), at a token of
    ``stop_token_ids``, at the end-of-sequence token unless ``ignore_eos``, or once the decoded
    output contains one of ``stop_strings`` (needs the engine's tokenizer; the text is cut before it).

    Log-probabilities are those of the model's distribution before temperature and filters:
    ``logprobs`` records the sampled token's, ``top_n_logprobs`` the ``n`` most likely tokens' at
    each step, ``prompt_logprobs`` each prompt token's given the tokens before it.

    Penalties, as in vLLM and the OpenAI API, change the logits before temperature and filters
    (greedy rows too): ``repetition_penalty`` (> 0, 1 = off) divides the positive and multiplies
    the negative logits of every token in the prompt or the output so far; ``frequency_penalty``
    (in [-2, 2], 0 = off) is subtracted once per occurrence of a token in the output so far and
    ``presence_penalty`` (in [-2, 2], 0 = off) once for any occurrence. Positive values discourage
    repetition. Log-probabilities stay those of the model, before penalties.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_tokens_to_generate: int | None = 16
    num_tokens_total: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_n_logprobs: int = 0
    prompt_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        """Whether ``temperature`` is 0 (argmax decoding)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` naming the first field outside its allowed range."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= vocab_size:
            raise InvalidRequestError("top_k", f"must be in [0, {vocab_size}] (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.num_tokens_to_generate is None and self.num_tokens_total is None:
            raise InvalidRequestError("num_tokens_to_generate", "set it or num_tokens_total")
        if self.num_tokens_to_generate is not None and self.num_tokens_to_generate < 0:
            raise InvalidRequestError(
                "num_tokens_to_generate", f"must be >= 0, got {self.num_tokens_to_generate}"
            )
        if self.num_tokens_total is not None and self.num_tokens_total < 1:
            raise InvalidRequestError("num_tokens_total", f"must be >= 1, got {self.num_tokens_total}")
        bad_stop = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stop:
            raise InvalidRequestError("stop_token_ids", f"must be in [0, {vocab_size}), got {bad_stop}")
        if any(not s for s in self.stop_strings):
            raise InvalidRequestError("stop_strings", "must be non-empty strings")
        if not 0 <= self.top_n_logprobs <= vocab_size:
            raise InvalidRequestError(
                "top_n_logprobs", f"must be in [0, {vocab_size}], got {self.top_n_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise InvalidRequestError(name, f"must be in [-2, 2] (0 = off), got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )

    def max_total_length(self, prompt_length: int) -> int:
        """Length (prompt + output) at which the request stops for length."""
        limits = []
        if self.num_tokens_to_generate is not None:
            limits.append(prompt_length + self.num_tokens_to_generate)
        if self.num_tokens_total is not None:
            limits.append(self.num_tokens_total)
        return min(limits)
