"""The coordinator's parts without engine processes: the wire protocol and its validation, the
serving-state machine, the routing policies, and the coordinator against raw ZMQ peers (malformed
frames, the handshake, acks from every engine, re-submission when an engine goes silent)."""

import asyncio
import threading
import time

import msgpack
import pytest
import zmq
from mcore_inference import (
    PROTOCOL_VERSION,
    IllegalControlSignalError,
    InferenceClient,
    InferenceCoordinator,
    InvalidRequestError,
    MessageKind,
    ProtocolError,
    RoutingPolicy,
    SamplingParams,
    ServingState,
)
from mcore_inference.protocol import (
    decode,
    encode,
    partial_outputs,
    sampling_params_from_dict,
    sampling_params_to_dict,
)
from mcore_inference.routing import Router
from mcore_inference.serving_state import next_state

TIMEOUT = 10


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


# ----------------------------------------------------------------- protocol
def test_partial_outputs_are_validated_item_by_item():
    good = [
        {"request_id": 1, "new_token_ids": [5], "logprobs": [-0.1]},
        {"request_id": 2, "new_token_ids": []},
    ]
    assert partial_outputs(decode(encode(MessageKind.PARTIAL_REPLY, outputs=good))[1]) == good
    with pytest.raises(ProtocolError, match="'outputs' must be list"):
        decode(encode(MessageKind.PARTIAL_REPLY, outputs={"request_id": 1}))
    for bad, needle in [
        ([[1, [5]]], r"outputs\[0\] has no int 'request_id'"),
        ([good[0], {"request_id": True, "new_token_ids": [5]}], r"outputs\[1\] has no int 'request_id'"),
        ([{"request_id": 3, "new_token_ids": 5}], r"outputs\[0\]: 'new_token_ids' must be list"),
    ]:
        with pytest.raises(ProtocolError, match=needle) as error:
            partial_outputs({"outputs": bad})
        assert error.value.request_id == (3 if "must be list" in needle else None)


def test_encode_decode_round_trip():
    frame = encode(MessageKind.SUBMIT, request_id=3, prompt_tokens=[1, 2], sampling_params={}, stream=True)
    assert decode(frame) == (
        MessageKind.SUBMIT,
        {"request_id": 3, "prompt_tokens": [1, 2], "sampling_params": {}, "stream": True},
    )
    assert decode(encode(MessageKind.PAUSE)) == (MessageKind.PAUSE, {})
    top = {"request_id": 0, "result": {"generated_top_logprobs": [{5: -0.1}]}}
    assert decode(encode(MessageKind.REPLY, **top))[1] == top  # int keys survive


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\xc1", "not a msgpack frame"),
        (msgpack.packb({"kind": 1}), "[kind, fields]"),
        (msgpack.packb([1, 2, 3]), "[kind, fields]"),
        (msgpack.packb([99, {}]), "unknown message kind 99"),
        (msgpack.packb([True, {}]), "must be an int"),
        (msgpack.packb([3.0, {}]), "must be an int"),
        (msgpack.packb([int(MessageKind.ABORT), {}]), "'request_id' must be int"),
        (msgpack.packb([int(MessageKind.ABORT), {"request_id": True}]), "'request_id' must be int"),
        (msgpack.packb([int(MessageKind.SUBMIT), {"request_id": 1}]), "'prompt_tokens' must be list"),
        (msgpack.packb([int(MessageKind.CONNECT), {1: 2}]), "field names must be strings"),
    ],
)
def test_malformed_frames_are_protocol_errors(frame, needle):
    with pytest.raises(ProtocolError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        decode(frame)


def test_a_malformed_request_keeps_its_id():
    frame = msgpack.packb([int(MessageKind.SUBMIT), {"request_id": 5, "prompt_tokens": [1], "stream": 1}])
    with pytest.raises(ProtocolError) as error:
        decode(frame)
    assert error.value.request_id == 5


def test_sampling_params_travel_explicitly():
    params = SamplingParams(temperature=0.5, top_k=3, seed=7, stop_token_ids=[1], stop_strings=["x"])
    assert sampling_params_from_dict(sampling_params_to_dict(params)) == params
    assert sampling_params_from_dict({}) == SamplingParams()
    with pytest.raises(InvalidRequestError) as error:
        sampling_params_from_dict({"temperature": 0, "max_tokens": 5})
    assert error.value.field == "max_tokens"


# ----------------------------------------------------------------- serving state
def test_state_machine_transitions():
    S = ServingState
    assert next_state(S.RUNNING, "pause") is S.PAUSED
    assert next_state(S.PAUSED, "unpause") is S.RUNNING
    assert next_state(S.PAUSED, "suspend") is S.SUSPENDED
    assert next_state(S.SUSPENDED, "resume") is S.PAUSED
    assert next_state(S.PAUSED, "stop") is S.STOPPED
    illegal = [
        (S.RUNNING, "unpause"),
        (S.RUNNING, "suspend"),
        (S.RUNNING, "resume"),
        (S.RUNNING, "stop"),
        (S.PAUSED, "pause"),
        (S.PAUSED, "resume"),
        (S.SUSPENDED, "pause"),
        (S.SUSPENDED, "unpause"),
        (S.SUSPENDED, "suspend"),
        (S.SUSPENDED, "stop"),
        *((S.STOPPED, signal) for signal in ("pause", "unpause", "suspend", "resume", "stop")),
    ]
    for state, signal in illegal:
        with pytest.raises(IllegalControlSignalError, match=f"cannot {signal} while {state.value}") as error:
            next_state(state, signal)
        assert (error.value.state, error.value.signal) == (state.value, signal)
    with pytest.raises(ValueError, match="unknown control signal"):
        next_state(S.RUNNING, "halt")


# ----------------------------------------------------------------- routing
def test_round_robin_and_least_loaded():
    router = Router(RoutingPolicy.ROUND_ROBIN)
    for engine in "abc":
        router.add_engine(engine)
    assert [router.choose([1], {}) for _ in range(7)] == list("abcabca")
    router.remove_engine("b")
    assert [router.choose([1], {}) for _ in range(4)] == list("caca")

    router = Router("least_loaded")
    for engine in "abc":
        router.add_engine(engine)
    assert router.choose([1], {"a": 2, "b": 0, "c": 1}) == "b"
    # ties go in turn
    assert [router.choose([1], {"a": 0, "b": 0, "c": 5}) for _ in range(4)] == list("abab")
    with pytest.raises(LookupError):
        Router("round_robin").choose([1], {})


def test_prefix_affinity():
    router = Router(RoutingPolicy.PREFIX_AFFINITY, prefix_block_size=4)
    for engine in "ab":
        router.add_engine(engine)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    first = router.choose([*shared, 1], {"a": 0, "b": 0})
    # the same two-block prefix goes to the same engine, even when it is the busier one
    loads = {first: 5, ({"a", "b"} - {first}).pop(): 0}
    assert all(router.choose([*shared, t, t], loads) == first for t in range(5))
    # a prompt sharing only the first block still follows it
    assert router.choose([9, 8, 7, 6, 0, 0, 0, 0], loads) == first
    # unknown prefixes and prompts shorter than a block go to the least loaded engine
    other = ({"a", "b"} - {first}).pop()
    assert router.choose([1, 1, 1, 1, 1], loads) == other
    assert router.choose([9, 8, 7], loads) == other
    router.remove_engine(first)  # its prefixes are forgotten
    assert router.choose(shared, {other: 3}) == other
    with pytest.raises(ValueError, match="prefix_block_size"):
        Router("prefix_affinity", prefix_block_size=0)


# ----------------------------------------------------------------- the coordinator against raw peers
@pytest.fixture
def coordinator():
    coordinator = InferenceCoordinator(heartbeat_timeout=0.5)
    coordinator.start()
    yield coordinator
    coordinator.close()


def dealer(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(address)
    return sock


def receive(sock):
    return decode(sock.recv())


def connect_engine(address, name):
    sock = dealer(address)
    sock.send(encode(MessageKind.CONNECT, version=PROTOCOL_VERSION, role="engine", name=name))
    assert receive(sock) == (MessageKind.CONNECT_ACK, {"version": PROTOCOL_VERSION, "state": "running"})
    return sock


def test_malformed_frames_are_answered_and_the_coordinator_keeps_serving(coordinator):
    sock = dealer(coordinator.address)
    for frame in (b"garbage", msgpack.packb([42, {}]), msgpack.packb([int(MessageKind.CONNECT), {}])):
        sock.send(frame)
        kind, fields = receive(sock)
        assert kind is MessageKind.ERROR and fields["code"] == "malformed"
    sock.send_multipart([b"two", b"frames"])  # dropped and logged
    sock.send(encode(MessageKind.SUBMIT, request_id=0, prompt_tokens=[1], sampling_params={}, stream=False))
    assert receive(sock)[1]["code"] == "not_connected"
    sock.send(encode(MessageKind.CONNECT, version=PROTOCOL_VERSION + 1, role="client", name="c"))
    kind, fields = receive(sock)
    assert fields["code"] == "version" and f"version {PROTOCOL_VERSION + 1}" in fields["message"]
    sock.send(encode(MessageKind.CONNECT, version=PROTOCOL_VERSION, role="client", name="c"))
    assert receive(sock)[0] is MessageKind.CONNECT_ACK
    assert coordinator.running
    sock.close()


def test_control_is_acknowledged_only_when_every_engine_acted():
    coordinator = InferenceCoordinator(heartbeat_timeout=TIMEOUT)  # silent fakes stay alive
    coordinator.start()
    engines = [connect_engine(coordinator.address, f"fake{i}") for i in range(2)]
    coordinator.wait_for_engines(2, TIMEOUT)

    async def body():
        client = InferenceClient(coordinator.address, timeout=TIMEOUT)
        pause = asyncio.ensure_future(client.pause())
        for sock in engines:
            assert await asyncio.to_thread(receive, sock) == (MessageKind.PAUSE, {})
        engines[0].send(encode(MessageKind.PAUSE_ACK))
        await asyncio.sleep(0.2)
        assert not pause.done()  # one engine has not acted yet
        engines[1].send(encode(MessageKind.PAUSE_ACK))
        await pause
        with pytest.raises(IllegalControlSignalError, match="cannot pause while paused"):
            await client.pause()
        with pytest.raises(IllegalControlSignalError, match="cannot resume while paused"):
            await client.resume()
        # an engine that goes away no longer holds the ack back
        unpause = asyncio.ensure_future(client.unpause())
        for sock in engines:
            assert await asyncio.to_thread(receive, sock) == (MessageKind.UNPAUSE, {})
        engines[0].send(encode(MessageKind.UNPAUSE_ACK))
        engines[1].send(encode(MessageKind.CONNECT, version=PROTOCOL_VERSION, role="engine", name="fake1"))
        await unpause  # fake1 reconnected: as a new engine, it owes no ack
        await client.close()

    try:
        run(body())
        assert coordinator.state is ServingState.RUNNING
    finally:
        for sock in engines:
            sock.close()
        coordinator.close()


def test_a_control_signal_with_no_engine_is_acknowledged_at_once(coordinator):
    async def body():
        client = InferenceClient(coordinator.address, timeout=TIMEOUT)
        await client.pause()
        await client.suspend()
        with pytest.raises(IllegalControlSignalError) as error:
            await client.unpause()
        assert (error.value.signal, error.value.state) == ("unpause", "suspended")
        await client.resume()
        await client.unpause()

    run(body())
    assert coordinator.state is ServingState.RUNNING


def test_a_silent_engine_is_lost_and_its_requests_resubmitted(coordinator):
    silent = connect_engine(coordinator.address, "silent")
    coordinator.wait_for_engines(1, TIMEOUT)

    async def body():
        client = InferenceClient(coordinator.address, timeout=TIMEOUT)
        result = asyncio.ensure_future(client.generate([1, 2, 3], SamplingParams(temperature=0)))
        kind, fields = await asyncio.to_thread(receive, silent)  # and never answers
        assert kind is MessageKind.SUBMIT and fields["prompt_tokens"] == [1, 2, 3]
        alive = await asyncio.to_thread(connect_engine, coordinator.address, "alive")
        started = time.monotonic()
        while True:  # heartbeats until the silent engine is declared lost
            alive.send(encode(MessageKind.HEARTBEAT, load=0))
            kind, fields = await asyncio.to_thread(receive, alive)
            if kind is MessageKind.SUBMIT:
                break
        assert time.monotonic() - started < 2.0  # heartbeat_timeout is 0.5 s
        assert coordinator.engines == ["alive"]
        reply = {"request_id": fields["request_id"], "status": "completed", "generated_tokens": [4]}
        alive.send(encode(MessageKind.REPLY, request_id=fields["request_id"], result=reply))
        done = await result
        assert (done.status, done.generated_tokens, done.engine, done.resubmissions) == (
            "completed",
            [4],
            "alive",
            1,
        )
        # a late reply of the lost engine is ignored
        silent.send(encode(MessageKind.REPLY, request_id=fields["request_id"], result=reply))
        alive.close()

    run(body())
    silent.close()


def test_one_partial_reply_of_an_engine_reaches_each_client_with_its_own_streams():
    """An engine sends one ``PARTIAL_REPLY`` for a step of several streams: each of two clients
    gets the tokens (and log-probabilities) of its own streams, under its own request ids; an
    unknown request id among them is skipped; a malformed item is answered with an error and the
    coordinator keeps serving."""
    coordinator = InferenceCoordinator(heartbeat_timeout=TIMEOUT)
    coordinator.start()
    engine = connect_engine(coordinator.address, "fake")
    coordinator.wait_for_engines(1, TIMEOUT)

    async def take(stream, count):
        return [await anext(stream) for _ in range(count)]

    async def body():
        clients = [InferenceClient(coordinator.address, timeout=TIMEOUT) for _ in range(2)]
        prompts = ([1, 2], [3, 4])
        sampling = SamplingParams(temperature=0, logprobs=True)
        streams = [client.stream(prompt, sampling) for client, prompt in zip(clients, prompts, strict=True)]
        first = [asyncio.ensure_future(take(stream, 2)) for stream in streams]
        # the two submissions may reach the engine in either order: find each client's by its prompt
        id_of_prompt = {}
        for _ in clients:
            kind, fields = await asyncio.to_thread(receive, engine)
            assert kind is MessageKind.SUBMIT
            id_of_prompt[tuple(fields["prompt_tokens"])] = fields["request_id"]
        ids = [id_of_prompt[tuple(prompt)] for prompt in prompts]
        outputs = [
            {"request_id": ids[0], "new_token_ids": [7], "logprobs": [-0.5]},
            {"request_id": 999, "new_token_ids": [1]},
            {"request_id": ids[1], "new_token_ids": [8], "logprobs": [-0.25]},
        ]
        engine.send(encode(MessageKind.PARTIAL_REPLY, outputs=outputs))
        engine.send(encode(MessageKind.PARTIAL_REPLY, outputs=[{"request_id": ids[1], "new_token_ids": 5}]))
        assert (await asyncio.to_thread(receive, engine))[1]["code"] == "malformed"
        for request_id, first_token, token in zip(ids, (7, 8), (9, 10), strict=True):
            reply = {
                "request_id": request_id,
                "status": "completed",
                "generated_tokens": [first_token, token],
            }
            engine.send(encode(MessageKind.REPLY, request_id=request_id, result=reply))
        chunks = [await task for task in first]
        assert [[(c.new_token_ids, c.finished) for c in mine] for mine in chunks] == [
            [([7], False), ([9], True)],
            [([8], False), ([10], True)],
        ]
        assert (chunks[0][0].logprobs, chunks[1][0].logprobs) == ([-0.5], [-0.25])

    try:
        run(body())
        assert coordinator.running
    finally:
        engine.close()
        coordinator.close()


def test_a_request_waits_for_an_engine_at_most_max_queue_wait():
    """With no engine, a request fails once it has waited ``max_queue_wait``; one that an engine
    connects for in time is served."""
    with pytest.raises(ValueError, match="max_queue_wait must be >= 0"):
        InferenceCoordinator(max_queue_wait=-1.0)
    with InferenceCoordinator(max_queue_wait=0.3) as coordinator:

        async def body():
            client = InferenceClient(coordinator.address, timeout=TIMEOUT)
            started = time.monotonic()
            failed = await client.generate([1, 2], SamplingParams(temperature=0))
            return failed, time.monotonic() - started

        failed, waited = run(body())
    assert (failed.status, failed.engine) == ("failed", None)
    assert failed.error == "CoordinatorError: no live engine took the request within 0.3 s"
    assert 0.3 <= waited < 3.0
    with InferenceCoordinator(max_queue_wait=TIMEOUT) as coordinator:

        async def served():
            client = InferenceClient(coordinator.address, timeout=TIMEOUT)
            result = asyncio.ensure_future(client.generate([1, 2], SamplingParams(temperature=0)))
            engine = await asyncio.to_thread(connect_engine, coordinator.address, "late")
            kind, fields = await asyncio.to_thread(receive, engine)
            assert kind is MessageKind.SUBMIT and fields["prompt_tokens"] == [1, 2]
            reply = {"request_id": fields["request_id"], "status": "completed", "generated_tokens": [3]}
            engine.send(encode(MessageKind.REPLY, request_id=fields["request_id"], result=reply))
            done = await result
            engine.close()
            return done

        done = run(served())
    assert (done.status, done.generated_tokens, done.engine) == ("completed", [3], "late")


def test_the_client_works_across_event_loops_and_refuses_bad_prompts(coordinator):
    client = InferenceClient(coordinator.address, timeout=TIMEOUT)
    for _ in range(2):  # each asyncio.run is a new loop: the client reconnects
        run(client.pause())
        run(client.unpause())

    async def bad():
        with pytest.raises(InvalidRequestError, match="prompt"):
            await client.generate("text prompt")
        result = await client.generate([1, 2.5])  # refused by the coordinator, not raised
        assert result.status == "failed" and result.error.startswith("InvalidRequestError: prompt")
        result = await client.generate([])
        assert result.status == "failed"

    run(bad())


def _coordinator_on_rank_zero():
    import torch.distributed as dist
    from mcore_inference import broadcast_coordinator_address

    coordinator = InferenceCoordinator() if dist.get_rank() == 0 else None
    address = broadcast_coordinator_address(coordinator.start() if coordinator else None)
    if dist.get_rank() == 1:  # a rank that needs the coordinator reaches it at the broadcast address
        client = InferenceClient(address, timeout=TIMEOUT)
        run(client.pause())
        run(client.unpause())
    dist.barrier()
    if coordinator is not None:
        coordinator.close()
    return address


def test_the_free_port_is_broadcast_to_the_ranks(run_distributed):
    first, second = run_distributed(_coordinator_on_rank_zero, 2)
    assert first == second and first.startswith("tcp://127.0.0.1:")


def test_a_client_without_a_coordinator_fails_in_time():
    from mcore_inference import CoordinatorError
    from mcore_parallel import find_free_port

    client = InferenceClient(f"tcp://127.0.0.1:{find_free_port()}", timeout=0.3)

    async def body():
        for _ in range(2):  # and again: a failed handshake is not taken for a connection
            with pytest.raises(CoordinatorError, match="no answer to CONNECT"):
                await client.pause()

    run(body())


def test_a_failing_handler_answers_with_an_error_and_serving_goes_on(coordinator):
    from mcore_inference import CoordinatorError

    def broken(client, fields):
        raise KeyError("a bug")

    coordinator._submit = broken  # as if handling SUBMIT had a bug

    async def body():
        client = InferenceClient(coordinator.address, timeout=TIMEOUT)
        with pytest.raises(CoordinatorError, match="internal: KeyError"):
            await client.generate([1, 2])
        await client.pause()  # still serving
        await client.unpause()

    run(body())
    assert coordinator.running


def test_requests_fail_when_the_coordinator_goes_silent():
    from mcore_inference import CoordinatorError

    coordinator = InferenceCoordinator()
    coordinator.start()
    client = InferenceClient(coordinator.address, timeout=0.6)

    async def body():
        waiting = asyncio.ensure_future(client.generate([1, 2]))  # no engine: it waits, answered
        await asyncio.sleep(1.5)  # longer than timeout: heartbeats are answered meanwhile
        assert not waiting.done()
        coordinator.close()
        started = time.monotonic()
        with pytest.raises(CoordinatorError, match="no answer from"):
            await waiting
        assert time.monotonic() - started < 2.0

    try:
        run(body())
    finally:
        coordinator.close()


class _IdleEngine:
    """The members of ``DynamicInferenceEngine`` that ``EngineEndpoint`` uses, with no work."""

    def has_unfinished_requests(self):
        return False

    def shutdown(self):
        self.shut = True


def test_an_engine_endpoint_gives_up_on_a_silent_coordinator():
    from mcore_inference import EngineEndpoint
    from mcore_parallel import find_free_port

    endpoint = EngineEndpoint(
        _IdleEngine(), f"tcp://127.0.0.1:{find_free_port()}", heartbeat_interval=0.05, coordinator_timeout=0.3
    )
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="nothing from the coordinator"):
        endpoint.run()
    assert time.monotonic() - started < 2.0


def test_an_engine_endpoint_stops_on_shutdown(coordinator):
    from mcore_inference import EngineEndpoint

    engine = _IdleEngine()
    endpoint = EngineEndpoint(engine, coordinator.address, name="idle", heartbeat_interval=0.05)
    thread = threading.Thread(target=endpoint.run, daemon=True)
    thread.start()
    coordinator.wait_for_engines(1, TIMEOUT)
    assert coordinator.engines == ["idle"]
    run(InferenceClient(coordinator.address, timeout=TIMEOUT).shutdown())
    thread.join(TIMEOUT)
    assert not thread.is_alive() and engine.shut and endpoint.shutdown_requested
    assert not coordinator.running


def test_a_step_longer_than_the_heartbeat_timeout_does_not_lose_the_engine(
    coordinator, make_model, make_engine
):
    """The endpoint heartbeats from its own thread during a step: an engine whose steps take three
    times the coordinator's heartbeat timeout (0.5 s) stays live and serves its request."""
    from mcore_inference import EngineEndpoint

    engine = make_engine(make_model())
    step = engine.step

    def slow_step():
        time.sleep(1.5)
        return step()

    engine.step = slow_step
    endpoint = EngineEndpoint(engine, coordinator.address, name="slow", heartbeat_interval=0.1)
    thread = threading.Thread(target=endpoint.run, daemon=True)
    thread.start()
    try:
        coordinator.wait_for_engines(1, TIMEOUT)
        params = SamplingParams(temperature=0, num_tokens_to_generate=2, ignore_eos=True)
        result = run(InferenceClient(coordinator.address, timeout=TIMEOUT).generate([1, 2, 3], params))
        assert (result.status, result.engine, result.resubmissions) == ("completed", "slow", 0)
        assert len(result.generated_tokens) == 2 and coordinator.engines == ["slow"]
    finally:
        endpoint.close()
        thread.join(TIMEOUT)


def test_a_client_learns_that_the_coordinator_restarted():
    from mcore_inference import CoordinatorError

    first = InferenceCoordinator()
    first.start()
    client = InferenceClient(first.address, timeout=TIMEOUT)

    async def body():
        waiting = asyncio.ensure_future(client.generate([1, 2]))  # no engine: it waits
        await asyncio.sleep(0.2)
        first.close()
        second = InferenceCoordinator(port=first.port)  # knows nothing of this client
        second.start()
        try:
            with pytest.raises(CoordinatorError, match="the coordinator restarted"):
                await waiting
            await client.pause()  # connected again
            assert second.state is ServingState.PAUSED
        finally:
            second.close()

    run(body())


def test_a_control_call_returns_on_its_own_ack_only():
    """A stray handshake ack arriving while ``pause`` waits is not taken for the pause's ack."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    answered = threading.Event()

    def fake_coordinator():
        for _ in range(2):  # the handshake, then the pause
            identity, frame = router.recv_multipart()
            kind, _ = decode(frame)
            if kind is MessageKind.CONNECT:
                router.send_multipart(
                    [identity, encode(MessageKind.CONNECT_ACK, version=PROTOCOL_VERSION, state="running")]
                )
        router.send_multipart(
            [identity, encode(MessageKind.CONNECT_ACK, version=PROTOCOL_VERSION, state="running")]
        )
        time.sleep(0.3)
        answered.set()
        router.send_multipart([identity, encode(MessageKind.PAUSE_ACK, state="paused")])

    thread = threading.Thread(target=fake_coordinator, daemon=True)
    thread.start()
    try:
        run(InferenceClient(f"tcp://127.0.0.1:{port}", timeout=TIMEOUT).pause())
        assert answered.is_set(), "pause returned before the coordinator acknowledged it"
    finally:
        thread.join(TIMEOUT)
        router.close()


def test_the_client_reader_ends_with_its_loop_while_frames_arrive():
    """``asyncio.run`` cancels the client's reader at shutdown; a cancellation that lands as a
    frame arrives must still end it (Python 3.11's ``wait_for`` swallowed exactly that one)."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def flooding_coordinator():  # acks every handshake, then sends heartbeats without pause
        identities = []
        while not stop.is_set():
            while router.poll(0):
                identity, frame = router.recv_multipart()
                if decode(frame)[0] is MessageKind.CONNECT:
                    ack = encode(MessageKind.CONNECT_ACK, version=PROTOCOL_VERSION, state="running")
                    router.send_multipart([identity, ack])
                    identities.append(identity)
            for identity in identities:
                router.send_multipart([identity, encode(MessageKind.HEARTBEAT, load=0)])

    async def connect_and_leave():
        await InferenceClient(f"tcp://127.0.0.1:{port}", timeout=TIMEOUT).connect()
        await asyncio.sleep(0.01)  # frames arrive meanwhile

    flood = threading.Thread(target=flooding_coordinator, daemon=True)
    flood.start()
    try:
        for attempt in range(40):
            loop_thread = threading.Thread(target=asyncio.run, args=(connect_and_leave(),), daemon=True)
            loop_thread.start()
            loop_thread.join(TIMEOUT)
            assert not loop_thread.is_alive(), f"asyncio.run never returned (attempt {attempt})"
    finally:
        stop.set()
        flood.join(TIMEOUT)
        router.close()
