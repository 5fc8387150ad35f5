"""One choice of a request: its engine request streamed, detokenized, cut at stop strings, timed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ..client import InferenceClient, RequestResult, StreamOutput
from ..sampling_params import SamplingParams
from .errors import from_failed_result
from .metrics import ServerMetrics
from .text_assembler import TextAssembler
from .tokenizer import ServingTokenizer

_STOP_TOKEN_REASONS = ("stop_token", "eos")
_FINISH_REASONS = {"stop_token": "stop", "eos": "stop", "stop_string": "stop", "length": "length"}


@dataclass
class ChoiceOutput:
    """What one choice produced: its text, the tokens behind it (then the stop token or EOS that
    ended it, whose text is not part of ``text``, as in vLLM), why it ended (``"stop"`` or
    ``"length"``, as in the OpenAI API), how many tokens the engine generated, and the
    log-probabilities of those tokens (``top_logprobs``: one ``{token id: logprob}`` a token)
    and, when asked for, of the prompt's (``None`` for its first token)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)


@dataclass
class Delta:
    """A piece of a choice's output: the text now safe to send (maybe empty) and the tokens that
    came with it, with their log-probabilities when the request asks for them (else empty). The
    stop token or EOS that ends a choice comes last, alone, with no text."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


class Choice:
    """Runs one engine request for a choice. Iterate ``deltas()`` for the text as it becomes safe
    to send; ``output`` is set once it ends. A stop string aborts the engine request at once.
    Leaving the iteration early (a client that disconnected) aborts it too. A failed request
    raises the ``OpenAIError`` of its error. With ``prompt_logprobs`` in ``params``, the prompt's
    log-probabilities are in ``prompt_logprobs`` / ``prompt_top_logprobs`` from the first delta on
    (or from the end, for a choice that yields none)."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: ServingTokenizer,
        prompt: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str],
        metrics: ServerMetrics,
    ):
        self.client, self.prompt, self.params, self.metrics = client, list(prompt), params, metrics
        self.assembler = TextAssembler(tokenizer, stop)
        self.output: ChoiceOutput | None = None
        self.prompt_logprobs: list[float | None] = []
        self.prompt_top_logprobs: list[dict[int, float] | None] = []
        self._start = time.monotonic()
        self._last_token: float | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """The choice's output, piece by piece."""
        result, outcome, stop = None, "error", None
        try:
            async for chunk in self.client.stream(self.prompt, self.params):
                if chunk.prompt_logprobs is not None:
                    self.prompt_logprobs = chunk.prompt_logprobs
                    self.prompt_top_logprobs = chunk.prompt_top_logprobs or []
                ids = chunk.new_token_ids
                if chunk.finished:
                    result = chunk.result
                    if result.finish_reason in _STOP_TOKEN_REASONS and ids:
                        # the stop token ends the output: its text is not part of it, its logprob is
                        stop = Delta("", ids[-1:], *_logprobs_of(chunk, len(ids) - 1, len(ids)))
                        ids = ids[:-1]
                if ids and not self.assembler.stopped:
                    delta = await self._take(chunk, ids)
                    if delta.text or delta.token_ids:
                        yield delta
            if self.assembler.stopped:  # a stop string ended the text before the stop token
                stop = None
            outcome = self._finish(result, stop)
            tail = self.assembler.finish()
            if tail:
                yield Delta(tail, [])
            if stop is not None:
                yield stop
        except (asyncio.CancelledError, GeneratorExit):  # the HTTP client left: the stream aborted
            outcome = "abort"
            raise
        finally:
            generated = len(result.generated_tokens) if result is not None else len(self.assembler.tokens)
            self.metrics.finished(outcome, len(self.prompt), generated, time.monotonic() - self._start)

    async def _take(self, chunk: StreamOutput, ids: list[int]) -> Delta:
        """Detokenize a chunk's tokens; a stop string aborts the engine request and drops the
        tokens after the one that completed the text before it."""
        self._time_tokens(len(ids))
        before = len(self.assembler.tokens)
        piece = self.assembler.add(ids)
        count = len(ids)
        if self.assembler.stopped:
            await self.client.abort(chunk.request_id)
            count = max(0, self.assembler.kept_tokens() - before)
        return Delta(piece, list(ids[:count]), *_logprobs_of(chunk, 0, count))

    async def run(self) -> ChoiceOutput:
        """Run to the end; the ``ChoiceOutput``."""
        async for _ in self.deltas():
            pass
        return self.output

    def _time_tokens(self, count: int) -> None:
        now = time.monotonic()
        if self._last_token is None:
            self.metrics.time_to_first_token.observe(now - self._start)
            count -= 1
        for _ in range(count):
            self.metrics.inter_token_latency.observe(now - (self._last_token or now))
        self._last_token = now

    def _finish(self, result: RequestResult, stop: Delta | None) -> str:
        """Set ``output`` from the engine's result (``stop``: the stop token kept after the
        text's tokens); the outcome to count."""
        if result.status == "failed":
            raise from_failed_result(result.error)
        if self.assembler.stopped:
            reason = "stop"
        elif result.status == "aborted":
            reason = "abort"
        else:
            reason = _FINISH_REASONS.get(result.finish_reason, "stop")
        kept = self.assembler.kept_tokens()
        token_ids = self.assembler.tokens[:kept] + (stop.token_ids if stop is not None else [])
        kept = len(token_ids)  # the engine's log-probabilities cover every generated token
        details = result.details
        self.output = ChoiceOutput(
            text=self.assembler.text,
            token_ids=token_ids,
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(result.generated_tokens),
            logprobs=list(details.get("generated_logprobs") or [])[:kept],
            top_logprobs=[dict(d) for d in (details.get("generated_top_logprobs") or [])[:kept]],
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
        )
        return reason


def _logprobs_of(chunk: StreamOutput, start: int, end: int) -> tuple[list[float], list[dict[int, float]]]:
    """The log-probabilities and alternatives of ``chunk``'s new tokens ``start:end`` (empty
    when the request asks for none)."""
    logprobs, top = chunk.logprobs or [], chunk.top_logprobs or []
    return list(logprobs[start:end]), [dict(d) for d in top[start:end]]
