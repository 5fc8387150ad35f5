"""Request lifecycle: validation failures that leave the engine serving, events and timestamps,
plain-dict form, transient errors retried by recompute."""

import json

import pytest
from mcore_inference import EngineShutdownError, RequestEventType, RequestStatus, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([1, 2], dict(num_tokens_to_generate=-1), "num_tokens_to_generate"),
        ([1, 2], dict(num_tokens_to_generate=500), "max_sequence_length"),
        ([], dict(), "prompt"),
        ([1, 128, -1], dict(), "prompt"),
        ([1, 2], dict(temperature=-0.5), "temperature"),
        ([1, 2], dict(top_p=2.0), "top_p"),
        ([1, 2, 3], dict(num_tokens_to_generate=None, num_tokens_total=3), "num_tokens_total"),
        ("text", dict(), "tokenizer"),
        ([1, 2], dict(stop_strings=["x"]), "stop_strings"),
    ],
)
def test_invalid_request_fails_alone(make_model, make_engine, oracle, prompt, params, field):
    model = make_model()
    engine = make_engine(model, blocks=32)  # 128 tokens of cache: max_sequence_length 128
    good = engine.add_request([5, 6, 7], SamplingParams(num_tokens_to_generate=4, **GREEDY))
    bad = engine.add_request(prompt, SamplingParams(**params))
    assert bad.status is RequestStatus.FAILED and bad.result(timeout=0) is bad
    kinds = [e.type for e in bad.events]
    assert kinds == [RequestEventType.ADD, RequestEventType.ERROR_NONTRANSIENT, RequestEventType.FAIL]
    assert field in bad.events[1].message and field in bad.error
    while engine.has_unfinished_requests():
        engine.step()
    assert good.status is RequestStatus.COMPLETED
    assert good.generated_tokens == oracle(model, [5, 6, 7], 4)


def test_events_timestamps_and_dict(make_model, make_engine):
    engine = make_engine(make_model(), max_tokens=4)
    (request,) = engine.generate(
        [[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(num_tokens_to_generate=5, **GREEDY)
    )
    kinds = [e.type for e in request.events]
    assert kinds == [RequestEventType.ADD, RequestEventType.FIRST_TOKEN, RequestEventType.FINISH]
    times = [e.timestamp for e in request.events]
    assert times == sorted(times)
    assert len(request.token_timestamps) == 5 and request.token_timestamps == sorted(request.token_timestamps)
    assert (
        request.time_to_first_token == pytest.approx(times[1] - times[0]) and request.time_to_first_token > 0
    )
    data = json.loads(json.dumps(request.to_dict()))
    assert data["status"] == "completed" and data["generated_tokens"] == request.generated_tokens
    assert [e["type"] for e in data["events"]] == ["add", "first_token", "finish"]
    assert data["sampling_params"]["num_tokens_to_generate"] == 5 and data["finish_reason"] == "length"


def test_transient_error_is_retried_then_fails(make_model, make_engine, oracle, flaky_model):
    model = make_model()
    engine = make_engine(flaky_model(model, failures=1))
    (request,) = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(num_tokens_to_generate=4, **GREEDY))
    kinds = [e.type for e in request.events]
    assert RequestEventType.ERROR_TRANSIENT in kinds and RequestEventType.EVICT in kinds
    assert request.status is RequestStatus.COMPLETED and request.generated_tokens == oracle(
        model, [1, 2, 3, 4, 5], 4
    )
    broken = make_engine(flaky_model(model, failures=100), max_transient_retries=2)
    (request,) = broken.generate([[1, 2, 3]], SamplingParams(**GREEDY))
    assert request.status is RequestStatus.FAILED and "device hiccup" in request.error
    assert [e.type for e in request.events].count(RequestEventType.ERROR_TRANSIENT) == 2
    assert request.events[-1].type is RequestEventType.FAIL


def test_shutdown_fails_pending_requests_and_refuses_new_ones(make_model, make_engine):
    engine = make_engine(make_model())
    requests = [engine.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=50)) for _ in range(3)]
    engine.step()
    engine.shutdown()
    for request in requests:
        assert request.result(timeout=1).status is RequestStatus.FAILED
        assert "shut down" in request.error
    assert not engine.has_unfinished_requests()
    assert engine.context.allocator.num_free_blocks == engine.context.num_blocks
    with pytest.raises(EngineShutdownError):
        engine.add_request([1], SamplingParams())
