"""``POST /v1/completions`` and ``POST /v1/chat/completions``: run the choices, answer whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .context import ServerContext
from .errors import OpenAIError, from_exception
from .generation import Choice, ChoiceOutput, Delta
from .openai_protocol import GenerationRequest, parse_chat, parse_completion
from .responses import (
    SSE_DONE,
    ResponseHeader,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    sse,
    total_usage,
)

_DISCONNECT_POLL_SECONDS = 0.25
CLIENT_CLOSED_REQUEST = 499
"""The status logged for a request whose client left before the answer (nginx's convention)."""


async def handle_generation(request: Request, ctx: ServerContext, chat: bool) -> Response:
    """Parse, admit and run a completions (``chat=False``) or chat completions request."""
    body = await ctx.read_json(request)
    ctx.check_model(body)
    if chat:
        generation = parse_chat(body, ctx.tokenizer, ctx.template, ctx.max_model_len)
    else:
        generation = parse_completion(body, ctx.tokenizer, ctx.max_model_len)
    ctx.admission.enter()
    prefix = "chatcmpl" if chat else "cmpl"
    header = ResponseHeader(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), ctx.model_name, chat)
    choices = [
        Choice(ctx.client, ctx.tokenizer, prompt, generation.choice_params(i), generation.stop, ctx.metrics)
        for prompt in generation.prompts
        for i in range(generation.n)
    ]
    if generation.stream:
        events = _events(ctx, header, generation, choices)  # leaves the admission when it ends
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        outputs = await _run_all(request, choices)
    finally:
        ctx.admission.leave()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(_whole_body(ctx, header, generation, outputs))


async def _run_all(request: Request, choices: Sequence[Choice]) -> list[ChoiceOutput] | None:
    """Run every choice; the first failure cancels the others and is raised. ``None`` if the
    client disconnected (the engine requests are then aborted)."""
    tasks = [asyncio.ensure_future(choice.run()) for choice in choices]
    try:
        while True:
            done, pending = await asyncio.wait(
                tasks, timeout=_DISCONNECT_POLL_SECONDS, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
            if not pending:
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                return None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _whole_body(
    ctx: ServerContext, header: ResponseHeader, generation: GenerationRequest, outputs: list[ChoiceOutput]
) -> dict:
    choices = []
    for index, output in enumerate(outputs):
        if header.chat:
            logprobs = None
            if generation.top_logprobs is not None:
                logprobs = chat_logprobs(
                    output, ctx.tokenizer, generation.top_logprobs, generation.tokens_as_ids
                )
            choices.append(chat_choice(index, output, logprobs))
        else:
            prompt = generation.prompts[index // generation.n]
            echo = ctx.tokenizer.decode(prompt) if generation.echo else ""
            logprobs = None
            if generation.top_logprobs is not None:
                as_ids = generation.tokens_as_ids
                logprobs = completion_logprobs(output, ctx.tokenizer, len(echo), as_ids)
                if generation.echo:
                    prompt_part = echo_logprobs(
                        prompt, output.prompt_logprobs, output.prompt_top_logprobs, ctx.tokenizer, as_ids
                    )
                    logprobs = joined_logprobs(prompt_part, logprobs)
            choices.append(completion_choice(index, output, echo, logprobs))
    return header.body(choices, total_usage(outputs, [len(p) for p in generation.prompts]))


async def _merged(choices: Sequence[Choice]) -> AsyncIterator[tuple[int, Delta | None]]:
    """``(choice index, Delta)`` as any choice produces output, ``(index, None)`` when it ends."""
    if len(choices) == 1:  # the common case: no task and queue between the choice and the stream
        async with contextlib.aclosing(choices[0].deltas()) as deltas:  # leaving early aborts it
            async for delta in deltas:
                yield 0, delta
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        for _ in range(len(choices)):
            while True:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield index, item
                if item is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _delta_choice(
    header: ResponseHeader, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    if header.chat:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _delta_logprobs(
    ctx: ServerContext, header: ResponseHeader, generation: GenerationRequest, delta: Delta, offset: int
) -> dict:
    if header.chat:
        return chat_logprobs(delta, ctx.tokenizer, generation.top_logprobs, generation.tokens_as_ids)
    return completion_logprobs(delta, ctx.tokenizer, offset, generation.tokens_as_ids)


def _echo_chunk(
    ctx: ServerContext,
    header: ResponseHeader,
    generation: GenerationRequest,
    choices: Sequence[Choice],
    index: int,
    sent: list[int],
) -> str:
    """The chunk that echoes choice ``index``'s prompt (with its log-probabilities when the request
    asks for them); counts its text in ``sent``."""
    prompt = generation.prompts[index // generation.n]
    echo, logprobs = ctx.tokenizer.decode(prompt), None
    if generation.top_logprobs is not None:
        choice = choices[index]
        logprobs = echo_logprobs(
            prompt,
            choice.prompt_logprobs,
            choice.prompt_top_logprobs,
            ctx.tokenizer,
            generation.tokens_as_ids,
        )
    sent[index] += len(echo)
    return header.chunk([_delta_choice(header, index, echo, None, logprobs)])


async def _events(
    ctx: ServerContext, header: ResponseHeader, generation: GenerationRequest, choices: Sequence[Choice]
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, ending with ``data: [DONE]``; a failure is
    sent as an error event before it."""
    sent = [0] * len(choices)  # characters of each choice's text sent so far
    # An echo with log-probabilities waits for the prompt's, which come with the choice's first output.
    echo_later = [generation.echo and generation.top_logprobs is not None] * len(choices)
    try:
        for index in range(len(choices)):
            if header.chat:
                delta = {"role": "assistant", "content": ""}
                yield header.chunk(
                    [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
            elif generation.echo and not echo_later[index]:
                yield _echo_chunk(ctx, header, generation, choices, index, sent)
        async for index, delta in _merged(choices):
            if echo_later[index]:
                yield _echo_chunk(ctx, header, generation, choices, index, sent)
                echo_later[index] = False
            if delta is None:
                yield header.chunk([_delta_choice(header, index, "", choices[index].output.finish_reason)])
                continue
            logprobs = None
            if generation.top_logprobs is not None and delta.token_ids:
                logprobs = _delta_logprobs(ctx, header, generation, delta, sent[index])
            if delta.text or logprobs is not None:
                yield header.chunk([_delta_choice(header, index, delta.text, None, logprobs)])
                sent[index] += len(delta.text)
        if generation.include_usage:
            outputs = [choice.output for choice in choices]
            yield header.chunk([], total_usage(outputs, [len(p) for p in generation.prompts]))
    except OpenAIError as error:
        yield sse(error.body())
    except Exception as error:  # the coordinator went away mid-stream: say so, then end the stream
        yield sse(from_exception(error).body())
    finally:
        ctx.admission.leave()
    yield SSE_DONE
