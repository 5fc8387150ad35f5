"""Abort: ``engine.abort(request_id)``, leaving a stream early and cancelling a ``generate_async``
task end the request as ABORTED at a step boundary, free its blocks, and leave the others' outputs
equal to the greedy oracle."""

import asyncio
import gc

import pytest
from mcore_inference import InvalidRequestError, RequestEventType, RequestStatus, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _all_blocks_free(engine):
    return engine.context.allocator.num_free_blocks == engine.context.num_blocks


def _assert_aborted(request, max_tokens):
    assert request.status is RequestStatus.ABORTED and request.finished
    assert request.finish_reason == "abort" and request.error is None
    assert request.events[-1].type is RequestEventType.ABORT
    assert request.result(timeout=0) is request
    assert len(request.generated_tokens) < max_tokens
    assert request.to_dict()["status"] == "aborted"


def test_abort_between_steps_frees_blocks_and_spares_the_others(make_model, make_engine, oracle):
    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=6, **GREEDY)
    outputs = []
    victim = engine.add_request(
        [10, 11, 12, 13], SamplingParams(num_tokens_to_generate=40, **GREEDY), on_output=outputs.append
    )
    others = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    held = len(victim.block_ids)
    assert held and victim.status is RequestStatus.ACTIVE
    free = engine.context.allocator.num_free_blocks
    assert engine.abort(victim.request_id) is True  # no step running: at once
    _assert_aborted(victim, 40)
    assert len(victim.generated_tokens) == 3 and not victim.block_ids
    assert engine.context.allocator.num_free_blocks == free + held
    assert outputs[-1].finished and outputs[-1].new_token_ids == [] and len(outputs) == 4
    assert engine.abort(victim.request_id) is False  # already finished: a no-op
    while engine.has_unfinished_requests():
        engine.step()
    for prompt, request in zip(PROMPTS, others, strict=True):
        assert request.generated_tokens == oracle(model, prompt, 6)
    assert _all_blocks_free(engine)


def test_abort_before_the_first_step_and_while_suspended(make_model, make_engine, oracle):
    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=5, **GREEDY)
    queued = engine.add_request([1, 2, 3], params)
    kept = engine.add_request([4, 5, 6], params)
    assert engine.abort(queued.request_id)
    _assert_aborted(queued, 1)
    engine.step()
    later = engine.add_request([7, 8], params)
    engine.step()
    engine.suspend()
    assert engine.abort(later.request_id)
    _assert_aborted(later, 5)
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert kept.generated_tokens == oracle(model, [4, 5, 6], 5)
    assert _all_blocks_free(engine)


def test_abort_from_a_callback_waits_for_the_step_boundary(make_model, make_engine, oracle):
    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=8, **GREEDY)
    seen = {}

    def abort_the_other(output):
        seen.setdefault("victim_tokens_at_abort", len(victim.generated_tokens))
        if len(output.request.generated_tokens) == 2:
            assert engine.abort(victim.request_id)
            assert not victim.finished  # not in the middle of the step

    trigger = engine.add_request([1, 2, 3], params, on_output=abort_the_other)
    victim = engine.add_request([4, 5, 6], params)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_aborted(victim, 8)
    assert len(victim.generated_tokens) == 2  # it got this step's token, then was aborted
    assert trigger.generated_tokens == oracle(model, [1, 2, 3], 8)
    assert _all_blocks_free(engine)


def test_abort_of_an_unknown_id_raises(make_model, make_engine):
    engine = make_engine(make_model())
    engine.add_request([1, 2], SamplingParams())
    for bad in (5, -1, "0", 0.0, True):
        with pytest.raises(InvalidRequestError) as info:
            engine.abort(bad)
        assert info.value.field == "request_id"
    failed = engine.add_request([], SamplingParams())  # failed at once: known, finished
    assert engine.abort(failed.request_id) is False


def _run_with_victim(engine, abandon, prompts, params):
    """Stream ``prompts`` to the end while a long victim request is abandoned by ``abandon``
    after its second token; return the victim ``Request`` and the others' tokens."""
    victims = []
    add_request = engine.add_request

    def recording_add_request(*args, **kwargs):
        request = add_request(*args, **kwargs)
        if len(request.prompt_tokens) == 6:
            victims.append(request)
        return request

    engine.add_request = recording_add_request

    async def collect(prompt):
        return [t async for o in engine.stream(prompt, params) for t in o.new_token_ids]

    async def main():
        others = [asyncio.create_task(collect(p)) for p in prompts]
        await abandon(engine, victims)
        tokens = await asyncio.wait_for(asyncio.gather(*others), 60)
        for _ in range(600):
            if victims[0].finished and not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert victims[0].finished  # inside the loop, not by asyncio.run's cleanup
        return tokens

    try:
        tokens = asyncio.run(main())
    finally:
        del engine.add_request
    return victims[0], tokens


LONG = SamplingParams(num_tokens_to_generate=60, **GREEDY)
VICTIM = [20, 21, 22, 23, 24, 25]


async def _break_then_aclose(engine, victims):
    stream = engine.stream(VICTIM, LONG)
    async for output in stream:
        if len(output.request.generated_tokens) == 2:
            break
    await stream.aclose()


async def _break_then_drop(engine, victims):
    stream = engine.stream(VICTIM, LONG)
    async for output in stream:
        if len(output.request.generated_tokens) == 2:
            break
    del stream, output
    gc.collect()  # the loop's async-generator finalizer closes it
    await asyncio.sleep(0.01)


async def _cancel_consuming_task(engine, victims):
    two = asyncio.Event()

    async def consume():
        async for output in engine.stream(VICTIM, LONG):
            if len(output.request.generated_tokens) == 2:
                two.set()

    task = asyncio.create_task(consume())
    await two.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _cancel_generate_async(engine, victims):
    task = asyncio.create_task(engine.generate_async(VICTIM, LONG))
    while not victims or len(victims[0].generated_tokens) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "abandon", [_break_then_aclose, _break_then_drop, _cancel_consuming_task, _cancel_generate_async]
)
def test_abandoned_streams_and_cancelled_tasks_abort(make_model, make_engine, oracle, abandon):
    model = make_model()
    engine = make_engine(model, blocks=48)
    params = SamplingParams(num_tokens_to_generate=12, **GREEDY)
    victim, tokens = _run_with_victim(engine, abandon, PROMPTS, params)
    _assert_aborted(victim, 60)
    assert len(victim.generated_tokens) >= 2
    assert tokens == [oracle(model, p, 12) for p in PROMPTS]
    assert not engine.has_unfinished_requests() and _all_blocks_free(engine)
