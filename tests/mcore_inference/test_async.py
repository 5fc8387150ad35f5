"""The asyncio API: concurrent streams inside a running loop, repeated calls, shutdown unblocking consumers."""

import asyncio

from mcore_inference import RequestStatus, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_concurrent_streams_match_blocking_generate(make_model, make_engine, prompts_factory):
    model = make_model()
    prompts = prompts_factory(4, 2, 12, seed=30)
    params = SamplingParams(num_tokens_to_generate=6, **GREEDY)
    expected = [r.generated_tokens for r in make_engine(model).generate(prompts, params)]
    engine = make_engine(model, max_tokens=8)

    async def collect(prompt):
        tokens, finished = [], []
        async for output in engine.stream(prompt, params):
            tokens += output.new_token_ids
            finished.append(output.finished)
        assert finished[-1] and not any(finished[:-1])
        return tokens

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    assert asyncio.run(main()) == expected
    # a second loop, and a call while a loop is running, both work
    assert asyncio.run(main()) == expected

    async def one():
        request = await engine.generate_async(prompts[0], params)
        return request.generated_tokens

    assert asyncio.run(one()) == expected[0]


def test_invalid_request_stream_ends_at_once(make_model, make_engine):
    engine = make_engine(make_model())

    async def main():
        return [o async for o in engine.stream([], SamplingParams())]

    (output,) = asyncio.run(main())
    assert output.finished and output.request.status is RequestStatus.FAILED


def test_shutdown_unblocks_every_consumer(make_model, make_engine):
    engine = make_engine(make_model())
    params = SamplingParams(num_tokens_to_generate=100, ignore_eos=True)

    async def consume(prompt, first_token):
        outputs = []
        async for output in engine.stream(prompt, params):
            outputs.append(output)
            first_token.set()
        return outputs

    async def main():
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(consume([1, 2, i], e)) for i, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        engine.shutdown()
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    for outputs in asyncio.run(main()):
        assert outputs[-1].finished and outputs[-1].request.status is RequestStatus.FAILED
        assert len(outputs[-1].request.generated_tokens) < 100
