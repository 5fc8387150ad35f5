"""The sampling options every inference handle accepts, checked once, and their engine form."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from mcore_api import experimental_api
from mcore_inference import SamplingParams

_FINISH_REASONS = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length"}


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@experimental_api
@dataclass(frozen=True)
class SamplingOptions:
    """How a handle samples: ``n`` completions per prompt, at most ``max_tokens`` tokens each;
    ``temperature`` (0 = greedy), then ``top_k`` (0 = off) and ``top_p`` (1 = off) filtering;
    ``seed`` (``None``: unseeded; sample ``j`` of prompt ``i`` of a call draws with
    ``seed + i * n + j``: every completion of a call its own stream, reproducible, as
    ``mcore-serve`` seeds the choices of a one-prompt request with ``seed + j``); ``stop``:
    strings that end a completion (its text is cut before them); ``ignore_eos``: go on past the
    end-of-sequence token. A bad value raises
    ``TypeError``/``ValueError`` naming the field and what is allowed; an unknown field is a
    ``TypeError``."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens"):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 1):
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not (_is_real(self.temperature) and (self.temperature == 0 or 0.01 <= self.temperature <= 1e4)):
            raise ValueError(f"temperature: must be 0 (greedy) or in [0.01, 1e4], got {self.temperature!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**62):
            raise ValueError(f"seed: must be None or an int in [0, 2**62), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"stop: must be a string or a list of non-empty strings, got {self.stop!r:.100}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")

    def prompt_seed(self, prompt_index: int) -> int | None:
        """The seed of prompt ``prompt_index``'s first sample (its sample ``j`` adds ``j``)."""
        return None if self.seed is None else self.seed + prompt_index * self.n

    def engine_params(self, sample_index: int, prompt_index: int = 0) -> SamplingParams:
        """The ``mcore_inference.SamplingParams`` of sample ``sample_index`` of prompt
        ``prompt_index`` (with log-probabilities)."""
        seed = self.prompt_seed(prompt_index)
        return SamplingParams(
            temperature=float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            seed=None if seed is None else seed + sample_index,
            num_tokens_to_generate=self.max_tokens,
            stop_strings=list(self.stop),
            ignore_eos=self.ignore_eos,
            logprobs=True,
        )


def finish_reason(engine_reason: str | None) -> str:
    """The OpenAI name (``"stop"`` / ``"length"``) of an mcore engine's finish reason."""
    return _FINISH_REASONS.get(engine_reason, engine_reason or "stop")
