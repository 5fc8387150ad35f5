"""The coordinator in front of real engine processes (loopback only): greedy outputs equal the
in-process engine's, routing policies, prefix affinity, abort, control signals acknowledged by every
engine, a slow engine not holding the others back, and an engine killed mid-stream.

Three engine processes (``coordinator_engine.py``: the conftest's tiny model; the third steps
0.1 s slower) start once for the module from a forkserver that imported torch once; each test
runs its own coordinator on the module's port, and the engines connect to whichever is there."""

import asyncio
import sys
import time
from pathlib import Path

import pytest
from mcore_inference import (
    IllegalControlSignalError,
    InferenceClient,
    InferenceCoordinator,
    SamplingParams,
    ServingState,
)
from mcore_parallel import find_free_port

sys.path.insert(0, str(Path(__file__).parent))
import coordinator_engine

pytestmark = pytest.mark.slow  # the engine processes take seconds to start (torch's import)

TIMEOUT = 60
SLOW = "slow"
NAMES = ["fast0", "fast1", SLOW]


@pytest.fixture(scope="module")
def engines():
    """``{name: process}`` of the module's engine processes, and the port they connect to."""
    port = find_free_port()
    delays = {name: 0.1 if name == SLOW else 0.0 for name in NAMES}
    processes = coordinator_engine.start_engine_processes(f"tcp://127.0.0.1:{port}", delays)
    yield processes, port
    coordinator_engine.stop_engine_processes(processes)


@pytest.fixture
def serve(engines):
    """``serve(**coordinator_kwargs)``: a coordinator on the module's port, once every live engine
    process has connected to it; closed after the test."""
    processes, port = engines
    started = []

    def start(**kwargs):
        coordinator = InferenceCoordinator(port=port, **kwargs)
        coordinator.start()
        started.append(coordinator)
        coordinator.wait_for_engines(sum(p.is_alive() for p in processes.values()), TIMEOUT)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.close()


def greedy(n):
    return SamplingParams(temperature=0, num_tokens_to_generate=n, ignore_eos=True)


def run(coro, timeout=TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_greedy_outputs_equal_the_in_process_engine(serve, expected, prompts_factory):
    coordinator = serve()
    prompts = prompts_factory(6, 3, 20, seed=1)

    async def body():
        client = InferenceClient(coordinator.address)
        results = await asyncio.gather(*(client.generate(p, greedy(8)) for p in prompts))
        streamed = []
        for prompt in prompts[:3]:
            chunks = [chunk async for chunk in client.stream(prompt, greedy(8))]
            assert all(len(c.new_token_ids) == 1 for c in chunks[:-1]) and chunks[-1].finished
            streamed.append(([t for c in chunks for t in c.new_token_ids], chunks[-1].result))
        # what the engine refuses fails alone, with the engine's message
        refused = await asyncio.gather(
            client.generate([1, 10**6], greedy(4)),
            client.generate([1, 2], SamplingParams(temperature=-1.0)),
        )
        assert [r.status for r in refused] == ["failed", "failed"]
        assert refused[0].error.startswith("InvalidRequestError: prompt")
        assert refused[1].error.startswith("InvalidRequestError: temperature")
        return results, streamed

    results, streamed = run(body())
    expected.prime(prompts, 8)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.status == "completed" and result.generated_tokens == expected(prompt, 8)
    for prompt, (tokens, result) in zip(prompts[:3], streamed, strict=True):
        assert tokens == result.generated_tokens == expected(prompt, 8)
    # round robin: six requests in turn over three engines
    assert sorted(r.engine for r in results) == sorted(NAMES * 2)
    assert [r.engine for r in results[:3]] == [r.engine for r in results[3:]]


def test_least_loaded_spreads_concurrent_requests(serve, expected):
    coordinator = serve(routing="least_loaded")

    async def body():
        client = InferenceClient(coordinator.address)
        return await asyncio.gather(*(client.generate([1, 2, 3, i], greedy(4)) for i in range(3)))

    results = run(body())
    assert sorted(r.engine for r in results) == sorted(NAMES)  # each engine had one, none two
    assert all(r.generated_tokens == expected([1, 2, 3, i], 4) for i, r in enumerate(results))


def test_prefix_affinity_sends_a_shared_prefix_to_one_engine(serve, expected):
    coordinator = serve(routing="prefix_affinity", prefix_block_size=4)
    shared = [5, 17, 29, 41, 53, 65, 77, 89]
    prompts = [[*shared, i] for i in range(5)] + [[100 + i, 3, 2, 1, 0] for i in range(3)]

    async def body():
        client = InferenceClient(coordinator.address)
        first = await client.generate(prompts[0], greedy(3))  # the prefix now lives on one engine
        rest = await asyncio.gather(*(client.generate(p, greedy(3)) for p in prompts[1:]))
        return [first, *rest]

    results = run(body())
    assert {r.engine for r in results[:5]} == {results[0].engine}
    assert len({r.engine for r in results[5:]}) > 1  # unrelated prompts spread by load
    for prompt, result in zip(prompts, results, strict=True):
        assert result.generated_tokens == expected(prompt, 3)


def test_abort_a_stream_and_a_generate(serve, expected):
    coordinator = serve()

    async def body():
        client = InferenceClient(coordinator.address)
        other = asyncio.ensure_future(client.generate([7, 7, 7], greedy(10)))
        stream = client.stream([1, 2, 3], greedy(200))
        first = await anext(stream)
        assert await client.abort(first.request_id)
        chunks = [chunk async for chunk in stream]
        final = chunks[-1].result
        assert final.status == "aborted" and final.finish_reason == "abort"
        assert 1 <= len(final.generated_tokens) < 200
        # leaving a stream early aborts too; a cancelled generate as well
        stream = client.stream([4, 5, 6], greedy(200))
        await anext(stream)
        await stream.aclose()
        task = asyncio.ensure_future(client.generate([8, 9], greedy(200)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await client.abort(first.request_id)  # already over
        return await other

    result = run(body())
    assert result.status == "completed" and result.generated_tokens == expected([7, 7, 7], 10)


def test_control_signals_reach_every_engine(serve, expected):
    coordinator = serve()

    async def body():
        client = InferenceClient(coordinator.address)
        with pytest.raises(IllegalControlSignalError, match="cannot suspend while running"):
            await client.suspend()
        await client.pause()
        pending = [asyncio.ensure_future(client.generate([3, 1, i], greedy(5))) for i in range(3)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in pending)  # paused engines do not step
        await client.suspend()  # every engine frees its KV cache
        with pytest.raises(IllegalControlSignalError, match="cannot unpause while suspended"):
            await client.unpause()
        await client.resume()
        await client.unpause()
        results = await asyncio.gather(*pending)
        assert all(r.generated_tokens == expected([3, 1, i], 5) for i, r in enumerate(results))
        # stop: from paused only; the engines shut down and unfinished requests fail
        with pytest.raises(IllegalControlSignalError, match="cannot stop while running"):
            await client.stop()
        await client.pause()
        waiting = asyncio.ensure_future(client.generate([2, 2], greedy(5)))
        await asyncio.sleep(0.2)
        await client.stop()
        stopped = await waiting
        assert stopped.status == "failed" and "shut down" in stopped.error
        late = await client.generate([2, 2], greedy(5))
        assert late.status == "failed" and "stopped" in late.error

    run(body())
    assert coordinator.state is ServingState.STOPPED


def test_a_slow_engine_does_not_hold_back_the_others(serve, expected):
    coordinator = serve()

    async def body():
        client = InferenceClient(coordinator.address)
        finished = {}

        async def one(i):
            result = await client.generate([9, 9, i], greedy(20))
            finished[result.engine] = time.monotonic()
            return result

        return await asyncio.gather(*(one(i) for i in range(3))), finished

    results, finished = run(body())
    assert sorted(finished) == sorted(NAMES)
    # the slow engine takes >= 2 s for its 20 tokens; the fast ones are done well before
    assert max(finished["fast0"], finished["fast1"]) < finished[SLOW] - 0.5
    assert all(r.generated_tokens == expected([9, 9, i], 20) for i, r in enumerate(results))


def test_an_engine_killed_mid_stream(serve, engines, expected):
    """Runs last in this module: it kills the slow engine's process."""
    processes, _ = engines
    coordinator = serve(heartbeat_timeout=1.0)
    prompts = [[11, 12, i] for i in range(9)]

    async def body():
        client = InferenceClient(coordinator.address)
        streams = {i: client.stream(prompts[i], greedy(30)) for i in range(0, 9, 2)}
        outcomes = {}
        for i in range(9):  # submitted in turn: each engine gets streams and whole requests
            if i in streams:
                outcomes[i] = asyncio.ensure_future(anext(streams[i]))
            else:
                outcomes[i] = asyncio.ensure_future(client.generate(prompts[i], greedy(30)))
        firsts = await asyncio.gather(*(outcomes[i] for i in streams))  # every stream has begun
        assert all(not chunk.finished for chunk in firsts)
        processes[SLOW].kill()
        killed, ended = time.monotonic(), {}

        async def rest(i, first):
            tokens = list(first.new_token_ids)
            async for chunk in streams[i]:
                tokens += chunk.new_token_ids
                result = chunk.result
            ended[i] = time.monotonic() - killed
            return tokens, result

        streamed = await asyncio.gather(*(rest(i, first) for i, first in zip(streams, firsts, strict=True)))
        whole = await asyncio.gather(*(outcomes[i] for i in range(9) if i not in streams))
        detected = max(ended[i] for i, (_, r) in zip(streams, streamed, strict=True) if r.status == "failed")
        after = await client.generate(prompts[0], greedy(30))  # service continues
        return streamed, whole, detected, after

    streamed, whole, detected, after = run(body())
    expected.prime(prompts, 30)
    assert detected < 1.0 + 3.0  # heartbeat_timeout, and slack for a loaded machine
    lost = [result for _, result in streamed if result.status == "failed"]
    assert lost, "the slow engine served a stream"
    for i, (tokens, result) in zip(range(0, 9, 2), streamed, strict=True):
        if result.status == "failed":
            assert result.error.startswith("EngineLostError: engine slow was lost")
            assert tokens == expected(prompts[i], 30)[: len(tokens)]  # what came was right
        else:
            assert tokens == result.generated_tokens == expected(prompts[i], 30)
    for i, result in zip([i for i in range(9) if i % 2], whole, strict=True):
        assert result.status == "completed" and result.generated_tokens == expected(prompts[i], 30)
    assert any(r.resubmissions == 1 for r in whole)  # the slow engine's whole requests moved
    assert after.status == "completed" and after.generated_tokens == expected(prompts[0], 30)
    assert sorted(coordinator.engines) == ["fast0", "fast1"]
