"""OpenAI request bodies to ``GenerationRequest``s: every field checked, mapped to ``SamplingParams``."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .chat_template import ChatTemplate, ChatTemplateError
from .errors import bad_request
from .tokenizer import ServingTokenizer

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` / ``top_logprobs`` may ask for."""
MAX_N = 64
"""The most choices one request may ask for."""

_SAMPLING_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options",
    "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "user", "return_tokens_as_token_ids",
)  # fmt: skip
COMPLETION_FIELDS = frozenset((*_SAMPLING_FIELDS, "prompt", "echo", "logprobs"))
"""Fields ``/v1/completions`` honours; any other (non-null) field is refused with a 400."""
CHAT_FIELDS = frozenset((*_SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs"))
"""Fields ``/v1/chat/completions`` honours; any other (non-null) field is refused with a 400."""
_ROLES = ("system", "developer", "user", "assistant")
# SamplingParams fields as the API names them, for errors from SamplingParams.validate
_API_NAMES = {"num_tokens_to_generate": "max_tokens", "top_n_logprobs": "logprobs"}


@dataclass
class GenerationRequest:
    """A checked request: the prompts (token ids, and their text), the sampling parameters of each
    choice (``seed + i`` for choice ``i`` when seeded), ``n`` choices per prompt, the stop strings
    (matched by the server on the text), and how to answer (``tokens_as_ids``: name the tokens
    of log-probabilities ``token_id:<id>``, vLLM's ``return_tokens_as_token_ids``)."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None  # None: no log-probabilities
    tokens_as_ids: bool = False

    def choice_params(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of a prompt."""
        if self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2**63)


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _int(
    body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise bad_request(name, f"{name} must be an integer, got {value!r:.100}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_request(name, f"{name} must be {allowed}, got {value}")
    return int(value)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise bad_request(name, f"{name} must be a finite number, got {value!r:.100}")
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be a boolean, got {value!r:.100}")
    return value


def _check_fields(body: Any, allowed: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unsupported = sorted(name for name, value in body.items() if name not in allowed and value is not None)
    if unsupported:
        raise bad_request(unsupported[0], f"unsupported parameter: {unsupported[0]}")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise bad_request("stop", "stop must be a non-empty string or a list of at most 16 of them")
    return stop


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream, options = _bool(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request("stream_options", "stream_options must be an object with only include_usage")
    return stream, _bool(options, "include_usage") if "include_usage" in options else False


def _sampling_params(
    body: dict[str, Any], max_tokens: int | None, top_logprobs: int | None
) -> SamplingParams:
    top_k = _int(body, "top_k", 0, -1)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad_request("stop_token_ids", "stop_token_ids must be a list of token ids")
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's "off"
        min_p=_number(body, "min_p", 0.0),
        seed=_int(body, "seed", None, 0, 2**63 - 1),
        num_tokens_to_generate=max_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=top_logprobs is not None,
        top_n_logprobs=top_logprobs or 0,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
    )


def _validate(params: SamplingParams, vocab_size: int) -> None:
    try:
        params.validate(vocab_size)
    except InvalidRequestError as error:
        name = _API_NAMES.get(error.field, error.field)
        message = str(error).partition(": ")[2]
        raise bad_request(name, f"{name}: {message}") from None


def _max_tokens(
    body: dict[str, Any], name: str, default: int | None, prompts: list[list[int]], limit: int, low: int = 1
) -> int:
    """``max_tokens`` (at least ``low``) checked against the context: every prompt plus it must
    fit ``limit``."""
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        param = "messages" if "messages" in body else "prompt"
        error = bad_request(param, f"the prompt has {longest} tokens; this model's context is {limit} tokens")
        error.code = "context_length_exceeded"
        raise error
    max_tokens = _int(body, name, default, low)
    if max_tokens is None:
        return limit - longest
    if longest + max_tokens > limit:
        raise bad_request(
            name,
            f"{name} is {max_tokens} but the prompt has {longest} tokens and the context {limit}: "
            f"at most {limit - longest}",
        )
    return max_tokens


def _prompt_tokens(prompt: Any, tokenizer: ServingTokenizer) -> list[list[int]]:
    """A completions ``prompt``: a string, a list of strings, a list of token ids, or a list of lists."""
    vocab = tokenizer.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", "prompt must be a string, a list of strings or a list of token ids")
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(tokenizer.encode(item))
        elif isinstance(item, list) and all(_is_token(t) for t in item):
            prompts.append([int(t) for t in item])
        else:
            raise bad_request("prompt", "prompt must be a string, a list of strings or a list of token ids")
        if not prompts[-1]:
            raise bad_request("prompt", "prompt must not be empty")
        if any(t >= vocab for t in prompts[-1]):
            raise bad_request("prompt", f"prompt token ids must be in [0, {vocab})")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _finish(
    body: dict[str, Any], prompts: list[list[int]], max_tokens: int, top_logprobs: int | None, vocab_size: int
) -> GenerationRequest:
    params = _sampling_params(body, max_tokens, top_logprobs)
    _validate(params, vocab_size)
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(
        prompts, params, n=_int(body, "n", 1, 1, MAX_N), stop=_stop(body), stream=stream,
        include_usage=include_usage, tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
    )  # fmt: skip


def parse_completion(body: Any, tokenizer: ServingTokenizer, max_model_len: int) -> GenerationRequest:
    """A ``/v1/completions`` body as a ``GenerationRequest`` (``OpenAIError`` 400 naming the
    field that is wrong or unsupported). ``max_tokens`` defaults to 16, as in the OpenAI API; with
    ``echo`` it may be 0 (the prompt alone, e.g. to score it with ``logprobs``), and ``logprobs``
    then covers the prompt's tokens too (the first has none)."""
    _check_fields(body, COMPLETION_FIELDS)
    if not _present(body, "prompt"):
        raise bad_request("prompt", "prompt is required")
    prompts = _prompt_tokens(body["prompt"], tokenizer)
    echo = _bool(body, "echo")
    max_tokens = _max_tokens(body, "max_tokens", 16, prompts, max_model_len, low=0 if echo else 1)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    request = _finish(body, prompts, max_tokens, logprobs, tokenizer.vocab_size)
    request.echo, request.top_logprobs = echo, logprobs
    if echo and logprobs is not None:
        request.params = replace(request.params, prompt_logprobs=True)
    return request


def _message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise bad_request("messages", f"messages[{index}] must be an object with a role in {list(_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise bad_request("messages", f"messages[{index}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request("messages", f"messages[{index}].content must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


def render_messages(messages: Any, template: ChatTemplate) -> str:
    """The prompt text of a chat ``messages`` list (400 naming ``messages`` if it is malformed
    or the template refuses it)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list of messages")
    try:
        return template.render([_message_text(m, i) for i, m in enumerate(messages)])
    except ChatTemplateError as error:
        raise bad_request("messages", str(error)) from None


def parse_chat(
    body: Any, tokenizer: ServingTokenizer, template: ChatTemplate, max_model_len: int
) -> GenerationRequest:
    """A ``/v1/chat/completions`` body as a ``GenerationRequest``: the messages rendered with
    ``template`` and encoded; ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest
    of the context."""
    _check_fields(body, CHAT_FIELDS)
    prompts = [tokenizer.encode(render_messages(body.get("messages"), template))]
    name = "max_completion_tokens" if _present(body, "max_completion_tokens") else "max_tokens"
    max_tokens = _max_tokens(body, name, None, prompts, max_model_len)
    top_logprobs = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not _bool(body, "logprobs"):
        raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
    logprobs = (top_logprobs or 0) if _bool(body, "logprobs") else None
    request = _finish(body, prompts, max_tokens, logprobs, tokenizer.vocab_size)
    request.top_logprobs = logprobs
    return request
