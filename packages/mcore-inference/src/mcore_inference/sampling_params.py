"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .errors import InvalidRequestError

_MIN_TEMPERATURE = 1e-2
"""The smallest non-zero ``temperature``: below it, logits divided by it may overflow to inf and
NaN (vLLM clamps to the same bound; here it is refused)."""
_MAX_TEMPERATURE = 1e4
"""The largest ``temperature``: far above any useful one, and finite in float32."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Filters apply in this order to the logits divided by ``temperature``: ``top_k`` (0 = off),
    ``top_p`` (1 = off), ``min_p`` (0 = off, relative to the most likely token). ``temperature=0``
    is greedy; otherwise it is in ``[0.01, 1e4]``. ``seed`` makes a request's samples reproducible whatever it is batched with.
    Generation stops after ``num_tokens_to_generate`` tokens, or when prompt + output reaches
    ``num_tokens_total`` (the stricter of both when both are set), at a token of
    ``stop_token_ids``, at the end-of-sequence token unless ``ignore_eos``, or once the decoded
    output contains one of ``stop_strings`` (needs the engine's tokenizer; the text is cut before it).

    Log-probabilities are those of the model's distribution before temperature and filters:
    ``logprobs`` records the sampled token's, ``top_n_logprobs`` the ``n`` most likely tokens' at
    each step, ``prompt_logprobs`` each prompt token's given the tokens before it (with
    ``top_n_logprobs``, also the ``n`` most likely tokens at each prompt position).

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
        """Raise ``InvalidRequestError`` naming the first field of the wrong type or outside its
        allowed range. ``temperature`` is 0 (greedy) or in ``[0.01, 1e4]``,
        so that finite logits divided by it stay finite."""
        temperature = self.temperature
        if not (
            _is_real(temperature)
            and (temperature == 0 or _MIN_TEMPERATURE <= temperature <= _MAX_TEMPERATURE)
        ):
            raise InvalidRequestError(
                "temperature",
                f"must be 0 (greedy) or a number in [{_MIN_TEMPERATURE}, {_MAX_TEMPERATURE}], got {temperature!r}",
            )
        if not (_is_int(self.top_k) and 0 <= self.top_k <= vocab_size):
            raise InvalidRequestError(
                "top_k", f"must be an int in [0, {vocab_size}] (0 = off), got {self.top_k!r}"
            )
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be None or an int in [0, 2**63), got {self.seed!r}")
        if self.num_tokens_to_generate is None and self.num_tokens_total is None:
            raise InvalidRequestError("num_tokens_to_generate", "set it or num_tokens_total")
        if self.num_tokens_to_generate is not None and not (
            _is_int(self.num_tokens_to_generate) and self.num_tokens_to_generate >= 0
        ):
            raise InvalidRequestError(
                "num_tokens_to_generate", f"must be None or an int >= 0, got {self.num_tokens_to_generate!r}"
            )
        if self.num_tokens_total is not None and not (
            _is_int(self.num_tokens_total) and self.num_tokens_total >= 1
        ):
            raise InvalidRequestError(
                "num_tokens_total", f"must be None or an int >= 1, got {self.num_tokens_total!r}"
            )
        stop = self.stop_token_ids
        if not isinstance(stop, (list, tuple)) or not all(_is_int(t) and 0 <= t < vocab_size for t in stop):
            raise InvalidRequestError(
                "stop_token_ids",
                f"must be a list of token ids (ints) in [0, {vocab_size}), got {stop!r:.200}",
            )
        strings = self.stop_strings
        if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
            raise InvalidRequestError(
                "stop_strings", f"must be a list of non-empty strings, got {strings!r:.200}"
            )
        for name in ("ignore_eos", "logprobs", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a bool, got {getattr(self, name)!r:.200}")
        if not (_is_int(self.top_n_logprobs) and 0 <= self.top_n_logprobs <= vocab_size):
            raise InvalidRequestError(
                "top_n_logprobs", f"must be an int in [0, {vocab_size}], got {self.top_n_logprobs!r}"
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
        generate, total = self.num_tokens_to_generate, self.num_tokens_total
        if total is None:
            return prompt_length + generate
        return total if generate is None else min(prompt_length + generate, total)
