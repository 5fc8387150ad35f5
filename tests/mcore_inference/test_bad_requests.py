"""Requests fail alone: whatever a caller sends, and whatever the logits hold at sampling time, only
the offending request fails (with the field or the reason), frees its blocks and leaves the others
equal to the greedy oracle; programming errors in a step surface instead of being retried."""

import asyncio
import logging

import numpy as np
import pytest
import torch
from mcore_inference import InvalidRequestError, RequestEventType, RequestStatus, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
GOOD_PROMPT = [5, 6, 7]


def _all_blocks_free(engine):
    return engine.context.allocator.num_free_blocks == engine.context.num_blocks


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([1.5, 2], SamplingParams(), "prompt"),
        ([1.0, 2.0], SamplingParams(), "prompt"),
        ([1, None], SamplingParams(), "prompt"),
        ([[1, 2], [3]], SamplingParams(), "prompt"),
        (7, SamplingParams(), "prompt"),
        (None, SamplingParams(), "prompt"),
        (b"\x01\x02", SamplingParams(), "prompt"),
        ({1: 2}, SamplingParams(), "prompt"),
        ({1, 2}, SamplingParams(), "prompt"),
        ([True, 2], SamplingParams(), "prompt"),
        (torch.tensor([1.0, 2.0]), SamplingParams(), "prompt"),
        ("text", SamplingParams(), "prompt"),  # no tokenizer
        ([1, 2], dict(temperature=0.0), "sampling_params"),
        ([1, 2], "greedy", "sampling_params"),
        ([1, 2], SamplingParams(temperature="0.5"), "temperature"),
        ([1, 2], SamplingParams(temperature=1e-40), "temperature"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
        ([1, 2], SamplingParams(temperature=float("inf")), "temperature"),
        ([1, 2], SamplingParams(temperature=1e30), "temperature"),
        ([1, 2], SamplingParams(temperature=True), "temperature"),
        ([1, 2], SamplingParams(top_k=-1), "top_k"),
        ([1, 2], SamplingParams(top_k=2.5), "top_k"),
        ([1, 2], SamplingParams(top_k=1000), "top_k"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p="1"), "top_p"),
        ([1, 2], SamplingParams(min_p=1.5), "min_p"),
        ([1, 2], SamplingParams(min_p=None), "min_p"),
        ([1, 2], SamplingParams(seed="1"), "seed"),
        ([1, 2], SamplingParams(seed=1.5), "seed"),
        ([1, 2], SamplingParams(seed=-1), "seed"),
        ([1, 2], SamplingParams(num_tokens_to_generate="5"), "num_tokens_to_generate"),
        ([1, 2], SamplingParams(num_tokens_to_generate=2.0), "num_tokens_to_generate"),
        ([1, 2], SamplingParams(num_tokens_total=4.5), "num_tokens_total"),
        ([1, 2], SamplingParams(stop_token_ids=["a"]), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids="12"), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids=[1.0]), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids=None), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_strings="\n"), "stop_strings"),
        ([1, 2], SamplingParams(stop_strings=[3]), "stop_strings"),
        ([1, 2], SamplingParams(ignore_eos="yes"), "ignore_eos"),
        ([1, 2], SamplingParams(logprobs=1), "logprobs"),
        ([1, 2], SamplingParams(top_n_logprobs=None), "top_n_logprobs"),
    ],
)
def test_bad_input_fails_that_request_with_the_field(make_model, make_engine, oracle, prompt, params, field):
    model = make_model()
    engine = make_engine(model, blocks=32)
    good = engine.add_request(GOOD_PROMPT, SamplingParams(num_tokens_to_generate=4, **GREEDY))
    outputs = []
    bad = engine.add_request(prompt, params, on_output=outputs.append)  # never raises
    assert bad.status is RequestStatus.FAILED and bad.finish_reason == "error"
    assert bad.error.startswith(f"InvalidRequestError: {field}: "), bad.error
    assert bad.result(timeout=0) is bad
    assert [e.type for e in bad.events] == [
        RequestEventType.ADD,
        RequestEventType.ERROR_NONTRANSIENT,
        RequestEventType.FAIL,
    ]
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].new_token_ids == []
    assert not bad.block_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert good.status is RequestStatus.COMPLETED
    assert good.generated_tokens == oracle(model, GOOD_PROMPT, 4)
    assert len(outputs) == 1 and _all_blocks_free(engine)


def test_validate_raises_invalid_request_error_naming_the_field():
    for params, field in [
        (SamplingParams(temperature=0.001), "temperature"),
        (SamplingParams(top_k=1.0), "top_k"),
        (SamplingParams(stop_token_ids=[200]), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            params.validate(vocab_size=128)
        assert info.value.field == field and isinstance(info.value, ValueError)
    for ok in [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.01),
        SamplingParams(temperature=2, top_k=128, top_p=0.5, min_p=1, seed=2**63 - 1),
        SamplingParams(num_tokens_to_generate=0),
        SamplingParams(num_tokens_to_generate=None, num_tokens_total=8, stop_token_ids=(1, np.int64(2))),
    ]:
        ok.validate(vocab_size=128)


def test_token_id_sequences_of_any_int_kind_are_accepted(make_model, make_engine):
    engine = make_engine(make_model())
    params = SamplingParams(num_tokens_to_generate=2, **GREEDY)
    prompts = [
        [3, 4, 5],
        (3, 4, 5),
        range(3, 6),
        torch.tensor([3, 4, 5]),
        np.array([3, 4, 5]),
        [np.int32(3), 4, torch.tensor(5)],
    ]
    requests = engine.generate(prompts, params)
    assert all(r.status is RequestStatus.COMPLETED for r in requests)
    assert all(r.prompt_tokens == [3, 4, 5] for r in requests)
    assert len({tuple(r.generated_tokens) for r in requests}) == 1


def test_generate_fails_bad_prompts_alone_and_refuses_a_bare_prompt(make_model, make_engine, oracle):
    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=3, **GREEDY)
    good, bad, bad_params = engine.generate([GOOD_PROMPT, [1.5], GOOD_PROMPT], [params, params, dict()])
    assert good.generated_tokens == oracle(model, GOOD_PROMPT, 3)
    assert bad.status is RequestStatus.FAILED and "prompt" in bad.error
    assert bad_params.status is RequestStatus.FAILED and "sampling_params" in bad_params.error
    for bare in ("a string", GOOD_PROMPT, 7, {1: [1, 2]}):
        with pytest.raises(InvalidRequestError, match="prompts"):
            engine.generate(bare, params)
    (from_tensor,) = engine.generate(torch.tensor([GOOD_PROMPT]), params)
    assert from_tensor.generated_tokens == good.generated_tokens
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        engine.generate([GOOD_PROMPT, GOOD_PROMPT], [params])
    assert not engine.has_unfinished_requests() and _all_blocks_free(engine)


class _Tokenizer:
    def encode(self, text):
        if text == "boom":
            raise UnicodeError("cannot encode")
        return [1.5] if text == "floats" else [ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_tokenizer_failures_fail_the_request(make_model, make_engine):
    engine = make_engine(make_model(), tokenizer=_Tokenizer())
    raised = engine.add_request("boom")
    floats = engine.add_request("floats")
    assert (
        raised.status is RequestStatus.FAILED and "prompt" in raised.error and "cannot encode" in raised.error
    )
    assert floats.status is RequestStatus.FAILED and "prompt" in floats.error
    (ok,) = engine.generate(["hello"], SamplingParams(num_tokens_to_generate=2, **GREEDY))
    assert ok.status is RequestStatus.COMPLETED and ok.generated_text is not None


class PoisonedModel:
    """Wraps a model; the logits rows of tokens at ``position`` become ``fill`` (a value, or a
    function of the row)."""

    def __init__(self, model, position, fill):
        self.model, self.position, self.fill = model, position, fill

    def __getattr__(self, name):
        return getattr(self.model, name)

    def inference_forward(self, input_ids, position_ids, context):
        logits = self.model.inference_forward(input_ids, position_ids, context)
        positions = position_ids.reshape(-1)[context.logits_indices.to(position_ids.device)]
        hit = positions == self.position
        if hit.any():
            logits = logits.clone()
            rows = hit.nonzero().flatten()
            for row in rows.tolist():
                logits[row] = self.fill(logits[row]) if callable(self.fill) else self.fill
        return logits


def _huge(row):  # finite, but over float32's range once divided by a temperature < 1
    row = row.clone()
    row[3] = 3e38
    return row


@pytest.mark.parametrize(
    "fill, victim_temperature, reason",
    [
        (float("nan"), 0.0, "non-finite"),
        (float("inf"), 0.0, "non-finite"),
        (float("-inf"), 0.0, "non-finite"),
        (float("nan"), 0.8, "non-finite"),
        (_huge, 0.5, "sampling failed"),
    ],
)
def test_bad_logits_fail_only_their_request(
    make_model, make_engine, oracle, fill, victim_temperature, reason
):
    """The victim's prompt is longer than the others' sequences ever get, so only its rows reach
    position 12: it fails after 3 tokens, mid-generation, while the others decode in the same steps."""
    model = make_model()
    victim_prompt = list(range(20, 30))  # positions 0..9; it samples at 9, 10, 11, then 12 (poisoned)
    prompts = [[1, 2, 3], [4, 5], [9, 8, 7, 6]]
    greedy = SamplingParams(num_tokens_to_generate=6, **GREEDY)
    seeded = [
        SamplingParams(num_tokens_to_generate=6, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)
    ]
    alone = make_engine(model).generate([prompts[0], prompts[0]], seeded)
    engine = make_engine(PoisonedModel(model, position=12, fill=fill), blocks=32)
    victim = engine.add_request(
        victim_prompt, SamplingParams(num_tokens_to_generate=10, temperature=victim_temperature, seed=3)
    )
    others = [engine.add_request(p, greedy) for p in prompts]
    sampled = [engine.add_request(prompts[0], s) for s in seeded]
    while engine.has_unfinished_requests():
        engine.step()
    assert victim.status is RequestStatus.FAILED and reason in victim.error
    assert len(victim.generated_tokens) == 3 and victim.events[-1].type is RequestEventType.FAIL
    for prompt, request in zip(prompts, others, strict=True):
        assert request.status is RequestStatus.COMPLETED
        assert request.generated_tokens == oracle(model, prompt, 6)
    # seeded draws do not depend on the batch, even when a row of it failed to sample
    assert [r.generated_tokens for r in sampled] == [r.generated_tokens for r in alone]
    assert _all_blocks_free(engine)


class BrokenModel:
    """Wraps a model; ``inference_forward`` raises ``error`` from call ``after`` on."""

    def __init__(self, model, error, after=0):
        self.model, self.error, self.calls, self.after = model, error, 0, after

    def __getattr__(self, name):
        return getattr(self.model, name)

    def inference_forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise self.error
        return self.model.inference_forward(*args, **kwargs)


@pytest.mark.parametrize(
    "error", [TypeError("bad argument"), NotImplementedError("no such path"), KeyError("k")]
)
def test_programming_errors_in_the_forward_surface(make_model, make_engine, oracle, error):
    model = make_model()
    broken = BrokenModel(model, error, after=1)
    engine = make_engine(broken)
    params = SamplingParams(num_tokens_to_generate=5, **GREEDY)
    requests = [engine.add_request(p, params) for p in ([1, 2, 3], [4, 5])]
    engine.step()
    with pytest.raises(type(error)):
        engine.step()
    assert broken.calls == 2  # not retried
    for request in requests:  # not left half-advanced holding blocks: failed with the error
        assert request.status is RequestStatus.FAILED and type(error).__name__ in request.error
        assert RequestEventType.ERROR_TRANSIENT not in [e.type for e in request.events]
    assert not engine.has_unfinished_requests() and _all_blocks_free(engine)
    broken.after = 10**9  # the engine keeps serving
    (request,) = engine.generate([[1, 2, 3]], params)
    assert request.generated_tokens == oracle(model, [1, 2, 3], 5)


class _FailsOnce(BrokenModel):
    def inference_forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise self.error
        return self.model.inference_forward(*args, **kwargs)


@pytest.mark.parametrize("error", [OSError("link down"), torch.cuda.OutOfMemoryError("out of memory")])
def test_transient_errors_in_the_forward_are_retried(make_model, make_engine, oracle, error):
    model = make_model()
    engine = make_engine(_FailsOnce(model, error))
    (request,) = engine.generate([[1, 2, 3]], SamplingParams(num_tokens_to_generate=4, **GREEDY))
    assert request.status is RequestStatus.COMPLETED
    assert request.generated_tokens == oracle(model, [1, 2, 3], 4)
    transient = [e.message for e in request.events if e.type is RequestEventType.ERROR_TRANSIENT]
    assert transient == [f"{type(error).__name__}: {error}"]


def test_a_programming_error_in_sampling_surfaces_without_half_advancing(
    make_model, make_engine, oracle, monkeypatch
):
    import mcore_inference.step_sampling as sampling_module

    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=4, **GREEDY)
    requests = [engine.add_request(p, params) for p in ([1, 2, 3], [4, 5])]
    real = {name: getattr(sampling_module, name) for name in ("sample", "argmax_rows")}
    for name in real:  # greedy rows without logprobs take argmax_rows, the others sample
        monkeypatch.setattr(
            sampling_module, name, lambda *a, **k: (_ for _ in ()).throw(TypeError("sampler bug"))
        )
    with pytest.raises(TypeError, match="sampler bug"):
        engine.step()
    for request in requests:
        assert request.status is RequestStatus.FAILED and "sampler bug" in request.error
        assert request.generated_tokens == []
    assert _all_blocks_free(engine)
    for name, function in real.items():
        monkeypatch.setattr(sampling_module, name, function)
    (request,) = engine.generate([[1, 2, 3]], params)
    assert request.generated_tokens == oracle(model, [1, 2, 3], 4)


def test_a_raising_callback_fails_only_its_request(make_model, make_engine, oracle, caplog):
    model = make_model()
    engine = make_engine(model)
    params = SamplingParams(num_tokens_to_generate=5, **GREEDY)

    def explode(output):
        if len(output.request.generated_tokens) == 2:
            raise ValueError("consumer gone")

    bad = engine.add_request([1, 2, 3], params, on_output=explode)
    good = engine.add_request([4, 5, 6], params, on_output=lambda output: None)
    with caplog.at_level(logging.ERROR, logger="mcore_inference.engine"):
        while engine.has_unfinished_requests():
            engine.step()
    assert bad.status is RequestStatus.FAILED and "on_output raised ValueError: consumer gone" in bad.error
    assert len(bad.generated_tokens) == 2 and "on_output" in caplog.text
    assert good.generated_tokens == oracle(model, [4, 5, 6], 5)
    assert _all_blocks_free(engine)


def test_a_step_error_in_the_async_driver_wakes_every_stream(make_model, make_engine):
    engine = make_engine(BrokenModel(make_model(), TypeError("model bug"), after=2))
    params = SamplingParams(num_tokens_to_generate=20, **GREEDY)

    async def consume(prompt):
        return [o async for o in engine.stream(prompt, params)]

    async def main():
        return await asyncio.wait_for(asyncio.gather(consume([1, 2]), consume([3, 4, 5])), 60)

    for outputs in asyncio.run(main()):  # the driver logs the error (not awaited here)
        assert outputs[-1].finished and outputs[-1].request.status is RequestStatus.FAILED
        assert "TypeError: model bug" in outputs[-1].request.error
    assert not engine.has_unfinished_requests() and _all_blocks_free(engine)


@pytest.mark.parametrize("poisoned_rank", [0, 1])
def test_sampling_failures_agree_over_tensor_parallel_ranks(
    run_distributed, split_model_builder, make_engine, oracle, poisoned_rank
):
    """Every rank takes the first tensor-parallel rank's verdict: its failure fails the request on
    both ranks (with the same message), a failure on the other rank alone is overruled."""

    def body():
        import torch.distributed as dist

        model, whole = split_model_builder(tp=2)
        if dist.get_rank() == poisoned_rank:
            model = PoisonedModel(model, position=12, fill=float("nan"))
        engine = make_engine(model, blocks=32)
        params = SamplingParams(num_tokens_to_generate=6, **GREEDY)
        victim = engine.add_request(list(range(20, 30)), params)
        other = engine.add_request([1, 2, 3], params)
        while engine.has_unfinished_requests():
            engine.step()
        return (
            victim.status.value,
            victim.error,
            victim.generated_tokens,
            other.generated_tokens == oracle(whole, [1, 2, 3], 6),
            _all_blocks_free(engine),
        )

    outcomes = run_distributed(body, 2, timeout=120)
    assert outcomes[0] == outcomes[1]
    status, error, tokens, other_equals_oracle, blocks_free = outcomes[0]
    assert other_equals_oracle and blocks_free
    if poisoned_rank == 0:
        assert status == "failed" and "non-finite logits" in error and len(tokens) == 3
    else:
        assert status == "completed" and error is None and len(tokens) == 6
