"""What the engine checks before a request is queued: the model it serves, the end-of-sequence
ids, and each prompt and its sampling parameters (a bad one fails its request alone)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mcore_models import InferenceModel, missing_inference_members

from .context import DynamicInferenceContext
from .errors import InvalidRequestError
from .request import Request
from .sampling_params import SamplingParams


def check_model(model: object) -> None:
    """``TypeError`` naming what ``model`` lacks of ``InferenceModel``; ``ValueError`` if it is
    in training mode."""
    missing = missing_inference_members(model)
    if missing:
        raise TypeError(
            f"model must implement mcore_models.InferenceModel; {type(model).__name__} lacks {', '.join(missing)}"
        )
    if model.training:
        raise ValueError("model is in training mode: call model.eval() first (the engine does not change it)")


def resolve_eos_token_ids(
    eos_token_id: int | Sequence[int] | None, model: InferenceModel, tokenizer: Any, vocab_size: int
) -> tuple[int, ...]:
    """The ids that end a request: ``eos_token_id`` (one id or a list; ``[]`` for none), else the
    model's ``eos_token_ids``, else the tokenizer's ``eod_id``, else none. An id outside
    ``[0, vocab_size)`` is a ``ValueError`` naming where it came from."""
    if eos_token_id is not None:
        source, ids = "eos_token_id", eos_token_id
    elif model.eos_token_ids:
        source, ids = "the model's eos_token_ids", model.eos_token_ids
    else:
        source, ids = "the tokenizer's eod_id", getattr(tokenizer, "eod_id", None)
    ids = () if ids is None else (ids,) if isinstance(ids, int) else tuple(ids)
    outside = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if outside:
        raise ValueError(
            f"{source} must be token ids in [0, {vocab_size}), got {outside}; "
            "pass eos_token_id (a list, [] for none) to choose others"
        )
    return ids


def token_ids(tokens: object, source: str) -> list[int]:
    """``tokens`` as a list of ints, or ``InvalidRequestError("prompt", ...)``: a list, tuple, range
    or 1-D integer tensor/array of ints; not a string, bytes, a mapping, a set, a scalar, floats,
    ``None``s or nested lists."""
    if isinstance(tokens, (str, bytes, bytearray, Mapping, set, frozenset)) or not isinstance(
        tokens, Iterable
    ):
        raise InvalidRequestError(
            "prompt", f"{source} must be a list of token ids (ints) or a string, got {type(tokens).__name__}"
        )
    ids = []
    for token in tokens:
        if isinstance(token, (bool, float)):
            raise InvalidRequestError("prompt", f"{source} token ids must be ints, got {token!r}")
        try:
            ids.append(operator.index(token))
        except TypeError:
            raise InvalidRequestError(
                "prompt", f"{source} token ids must be ints, got {token!r:.80} ({type(token).__name__})"
            ) from None
    return ids


def tokenize(prompt: Sequence[int] | str, tokenizer: Any) -> list[int]:
    """The token ids of ``prompt``: checked ids, or a text encoded by ``tokenizer`` (whose failure
    is this request's ``InvalidRequestError``)."""
    if not isinstance(prompt, str):
        return token_ids(prompt, "prompt")
    if tokenizer is None:
        raise InvalidRequestError("prompt", "a text prompt needs an engine with a tokenizer")
    try:
        encoded = tokenizer.encode(prompt)
    except Exception as error:  # the tokenizer is the caller's; its failure is this request's
        raise InvalidRequestError(
            "prompt", f"the tokenizer could not encode it: {type(error).__name__}: {error}"
        ) from error
    return token_ids(encoded, "the tokenizer's encoding of prompt:")


def validate_request(
    request: Request, vocab_size: int, tokenizer: Any, context: DynamicInferenceContext
) -> None:
    """Raise ``InvalidRequestError`` naming the field of ``request`` that cannot be served (or
    ``MaxSequenceLengthOverflowError`` when it would outgrow ``context``)."""
    params, prompt = request.sampling_params, request.prompt_tokens
    params.validate(vocab_size)
    if not prompt:
        raise InvalidRequestError("prompt", "must hold at least one token")
    outside = [t for t in prompt if not 0 <= t < vocab_size]
    if outside:
        raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab_size}), got {outside[:8]}")
    if params.num_tokens_total is not None and params.num_tokens_total <= len(prompt):
        raise InvalidRequestError(
            "num_tokens_total",
            f"must exceed the prompt length {len(prompt)}, got {params.num_tokens_total}",
        )
    if params.stop_strings and tokenizer is None:
        raise InvalidRequestError("stop_strings", "need an engine with a tokenizer")
    context.check_sequence_length(params.max_total_length(len(prompt)))


def prompts_with_params(
    prompts: object, sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> list[tuple[Any, SamplingParams | None]]:
    """``generate``'s ``prompts`` paired with their parameters (one for all, or one each); a single
    prompt instead of a list of them, or a list of parameters of another length, raises
    ``InvalidRequestError`` (each prompt and parameter is checked by ``add_request``)."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise InvalidRequestError(
            "prompts",
            f"must be a list of prompts (wrap a single one in a list), got {type(prompts).__name__}",
        )
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise InvalidRequestError(
            "prompts", "must be a list of prompts, got one list of ints: wrap it in a list"
        )
    if not isinstance(sampling_params, (list, tuple)):  # one for all (add_request checks it)
        return [(prompt, sampling_params) for prompt in prompts]
    if len(sampling_params) != len(prompts):
        raise InvalidRequestError(
            "sampling_params",
            f"got {len(sampling_params)} for {len(prompts)} prompts; give one, or one each",
        )
    return list(zip(prompts, sampling_params, strict=True))
