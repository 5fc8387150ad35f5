"""``TrainingSequence``: one rollout ready to train on, and the checks it must pass to be packed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mcore_api import experimental_api

from .._checks import is_real


@experimental_api
@dataclass(frozen=True)
class TrainingSequence:
    """One rollout: ``prompt_ids`` and ``completion_ids`` (token ids), ``sampling_logprobs`` (the
    inference engine's log-prob of each completion token), the completion's ``advantage`` and,
    optionally, ``ref_logprobs`` (the reference policy's log-prob of each completion token).

    Token ids and log-probs may be Python sequences or 1-D tensors."""

    prompt_ids: Sequence[int] | torch.Tensor
    completion_ids: Sequence[int] | torch.Tensor
    sampling_logprobs: Sequence[float] | torch.Tensor
    advantage: float
    ref_logprobs: Sequence[float] | torch.Tensor | None = None


@dataclass(frozen=True)
class CheckedSequence:
    """A ``TrainingSequence`` checked, as Python lists: ids ``int`` >= 0, log-probs finite
    ``float`` <= 0 (values of float32 precision where they came as tensors)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]
    advantage: float
    ref_logprobs: list[float] | None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def check_sequence(sequence: object, name: str) -> CheckedSequence:
    """``sequence`` as a ``CheckedSequence``; ``TypeError``/``ValueError`` naming ``name`` and the field."""
    if not isinstance(sequence, TrainingSequence):
        raise TypeError(f"{name}: must be a TrainingSequence, got {type(sequence).__name__}")
    if not is_real(sequence.advantage):
        raise ValueError(f"{name}.advantage: must be a finite number, got {sequence.advantage!r}")
    prompt = _token_ids(f"{name}.prompt_ids", sequence.prompt_ids)
    if len(prompt) == 0:
        raise ValueError(
            f"{name}.prompt_ids: must not be empty (the last prompt token predicts the first completion token)"
        )
    completion = _token_ids(f"{name}.completion_ids", sequence.completion_ids)
    if len(completion) == 0:
        raise ValueError(f"{name}.completion_ids: must not be empty (nothing to train on)")
    sampling = _logprobs(f"{name}.sampling_logprobs", sequence.sampling_logprobs, len(completion))
    ref = None
    if sequence.ref_logprobs is not None:
        ref = _logprobs(f"{name}.ref_logprobs", sequence.ref_logprobs, len(completion))
    return CheckedSequence(prompt, completion, sampling, float(sequence.advantage), ref)


def _token_ids(name: str, values: object) -> list[int]:
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):  # the common case
        if values and min(values) < 0:
            raise ValueError(f"{name}: token ids must be >= 0, got {min(values)}")
        return list(values)
    tensor = _one_dimensional(name, values)
    if len(tensor) == 0:
        return []
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name}: must hold integer token ids, got dtype {tensor.dtype}")
    if int(tensor.min()) < 0:
        raise ValueError(f"{name}: token ids must be >= 0, got {int(tensor.min())}")
    return tensor.tolist()


def _logprobs(name: str, values: object, length: int) -> list[float]:
    if (
        isinstance(values, (list, tuple))
        and len(values) == length
        and all(type(v) is float and -math.inf < v <= 0 for v in values)
    ):  # the common case: finite floats <= 0 (the checks below name what is wrong otherwise)
        return list(values)
    tensor = _one_dimensional(name, values)
    if len(tensor) != length:
        raise ValueError(f"{name}: must hold one value per completion token ({length}), got {len(tensor)}")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name}: must hold real log-probs, got dtype {tensor.dtype}")
    tensor = tensor.to(torch.float32)
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name}: must be finite, got {tensor[~torch.isfinite(tensor)][0].item()}")
    if bool((tensor > 0).any()):
        raise ValueError(f"{name}: log-probs must be <= 0, got {tensor.max().item()}")
    return tensor.tolist()


def _one_dimensional(name: str, values: object) -> torch.Tensor:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Tensor)):
        raise TypeError(f"{name}: must be a sequence or a 1-D tensor, got {type(values).__name__}")
    try:
        tensor = values.detach().cpu() if isinstance(values, torch.Tensor) else torch.tensor(list(values))
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name}: must hold numbers, got {list(values)[:4]!r}...: {error}") from None
    if tensor.dim() != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor
