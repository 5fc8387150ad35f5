"""OpenAI response bodies and streamed chunks for completions and chat completions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .generation import ChoiceOutput, Delta
from .tokenizer import ServingTokenizer


@dataclass
class ResponseHeader:
    """What every body and chunk of one response repeats: its id, creation time and model."""

    id: str
    created: int
    model: str
    chat: bool

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        """A whole response or a chunk (``object`` names which)."""
        kind = "chat.completion" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or not self.chat:
            body["usage"] = usage
        return body

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        """One server-sent event: a chunk of a streamed response."""
        body = self.body(choices, usage)
        if self.chat:
            body["object"] = "chat.completion.chunk"
        return sse(body)


def sse(body: Any) -> str:
    """``body`` as one server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


TOKEN_ID_PREFIX = "token_id:"
"""How ``return_tokens_as_token_ids`` names a token: ``token_id:<id>``, as vLLM does."""


def token_name(token_id: int, tokenizer: ServingTokenizer, as_id: bool) -> str:
    """A token as a response names it: its text, or ``token_id:<id>`` when ``as_id``."""
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_id else tokenizer.token_text(token_id)


def completion_logprobs(
    output: ChoiceOutput | Delta, tokenizer: ServingTokenizer, offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    """The completions ``logprobs`` object: tokens (named by ``token_name``), their
    log-probabilities, the alternatives and each token's offset in the text (the first at
    ``offset``)."""
    return _logprobs_object(output.token_ids, output.logprobs, output.top_logprobs, tokenizer, offset, as_ids)


def echo_logprobs(
    prompt: Sequence[int],
    logprobs: Sequence[float | None],
    top_logprobs: Sequence[dict[int, float] | None],
    tokenizer: ServingTokenizer,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The completions ``logprobs`` object of an echoed prompt, its text starting at offset 0;
    the first token has no log-probability and no alternatives (``None``)."""
    return _logprobs_object(prompt, logprobs, top_logprobs, tokenizer, 0, as_ids)


def joined_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects of consecutive text as one (echoed prompt, then output)."""
    top = (first["top_logprobs"] or []) + (second["top_logprobs"] or [])
    joined = {key: first[key] + second[key] for key in ("tokens", "token_logprobs", "text_offset")}
    return {**joined, "top_logprobs": top or None}


def _logprobs_object(
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    top_logprobs: Sequence[dict[int, float] | None],
    tokenizer: ServingTokenizer,
    offset: int,
    as_ids: bool,
) -> dict[str, Any]:
    offsets = []  # into the text, whatever names the tokens
    for token_id in token_ids:
        offsets.append(offset)
        offset += len(tokenizer.token_text(token_id))
    tops = [
        None if top is None else {token_name(t, tokenizer, as_ids): p for t, p in top.items()}
        for top in top_logprobs
    ]
    return {
        "tokens": [token_name(t, tokenizer, as_ids) for t in token_ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": tops or None,
        "text_offset": offsets,
    }


def _entry(token_id: int, logprob: float, tokenizer: ServingTokenizer, as_id: bool) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)  # ``bytes`` are the text's, whatever names the token
    return {
        "token": token_name(token_id, tokenizer, as_id),
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
    }


def chat_logprobs(
    output: ChoiceOutput | Delta, tokenizer: ServingTokenizer, top: int, as_ids: bool = False
) -> dict[str, Any]:
    """The chat ``logprobs`` object: one entry a token (named by ``token_name``), with its ``top``
    alternatives."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(output.token_ids, output.logprobs, strict=False)):
        entry = _entry(token_id, logprob, tokenizer, as_ids)
        alternatives = sorted(output.top_logprobs[i].items(), key=lambda kv: -kv[1])[:top] if top else []
        entry["top_logprobs"] = [_entry(t, p, tokenizer, as_ids) for t, p in alternatives]
        content.append(entry)
    return {"content": content}


def completion_choice(
    index: int, output: ChoiceOutput, prefix: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice of a completions response (``prefix``: the prompt text when echoing)."""
    return {
        "index": index,
        "text": prefix + output.text,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason,
    }


def chat_choice(index: int, output: ChoiceOutput, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One choice of a chat response."""
    message = {"role": "assistant", "content": output.text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": output.finish_reason}


def total_usage(outputs: Sequence[ChoiceOutput], prompt_lengths: Sequence[int]) -> dict[str, int]:
    """Usage of a whole request: each prompt counted once, every choice's generated tokens."""
    return usage(sum(prompt_lengths), sum(o.completion_tokens for o in outputs))
