"""Greedy outputs of the engine equal the full-recompute oracle under batching, chunked prefill,
prefix-cache hits, preemption and suspend/resume (fp32 tiny models, exact token equality)."""

import pytest
import torch
from mcore_inference import RequestEventType, RequestStatus, SamplingParams
from mcore_kernels import use_backend

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _check(model, oracle, prompts, requests, lengths):
    for prompt, request, n in zip(prompts, requests, lengths, strict=True):
        assert request.status is RequestStatus.COMPLETED, request.error
        assert request.generated_tokens == oracle(model, prompt, n)


@pytest.mark.parametrize("backend", ["auto", "reference"])  # decode on the native kernel, or not
@pytest.mark.parametrize("variant", ["llama-like", "gpt-like"])
@pytest.mark.parametrize(
    "limits",
    [dict(max_tokens=512, max_requests=64), dict(max_tokens=7, max_requests=3)],
    ids=["wide", "chunked"],
)
def test_batched_and_chunked_prefill_match_oracle(
    make_model, make_engine, oracle, prompts_factory, variant, limits, backend
):
    model = make_model(variant)
    engine = make_engine(model, blocks=96, **limits)
    prompts = prompts_factory(6, 1, 30, seed=1)
    lengths = torch.randint(1, 10, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    requests = [
        engine.add_request(p, SamplingParams(num_tokens_to_generate=n, **GREEDY))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    with use_backend(backend):
        while engine.has_unfinished_requests():
            engine.step()
            assert len(engine.context.token_slots) <= limits["max_tokens"]
    _check(model, oracle, prompts, requests, lengths)
    assert engine.context.allocator.num_free_blocks == 96  # everything released (cached blocks evictable)


def test_requests_arriving_mid_run_match_oracle(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    engine = make_engine(model, blocks=64, max_tokens=16)
    prompts = prompts_factory(6, 3, 25, seed=3)
    requests = []
    for prompt in prompts:  # a new request every two steps, joining running decodes
        requests.append(engine.add_request(prompt, SamplingParams(num_tokens_to_generate=6, **GREEDY)))
        engine.step()
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    _check(model, oracle, prompts, requests, [6] * 6)


def test_prefix_cache_hits_match_oracle(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    engine = make_engine(model, blocks=64, max_tokens=32)
    (shared,) = prompts_factory(1, 13, 13, seed=4)
    tails = prompts_factory(4, 1, 6, seed=5)
    prompts = [shared + tail for tail in tails] + [shared[:8], shared]
    first = engine.generate(prompts[:1], SamplingParams(num_tokens_to_generate=5, **GREEDY))
    rest = engine.generate(prompts[1:], SamplingParams(num_tokens_to_generate=5, **GREEDY))
    # 3 full blocks of 4 shared (12 tokens) for each of the 3 later long prompts, 4 for shared[:8]
    # (it keeps its last token to compute), 12 for `shared` itself.
    assert engine.scheduler.prefix_cache_hit_tokens >= 3 * 12 + 4 + 12
    _check(model, oracle, prompts, first + rest, [5] * 6)


def test_preemption_recomputes_and_matches_oracle(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    engine = make_engine(model, blocks=12, block_size=4, max_tokens=16, enable_prefix_caching=False)
    prompts = prompts_factory(5, 5, 12, seed=6)
    requests = engine.generate(prompts, SamplingParams(num_tokens_to_generate=12, **GREEDY))
    evictions = sum(e.type is RequestEventType.EVICT for r in requests for e in r.events)
    assert evictions > 0  # 5 requests of up to 24 tokens cannot share 48 slots
    _check(model, oracle, prompts, requests, [12] * 5)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_mix_with_prefix_hits_preemption_and_suspend(
    make_model, make_engine, oracle, prompts_factory, seed
):
    model = make_model()
    gen = torch.Generator().manual_seed(seed)
    engine = make_engine(
        model,
        blocks=int(torch.randint(10, 30, (1,), generator=gen)),
        max_tokens=int(torch.randint(4, 20, (1,), generator=gen)),
    )
    base = prompts_factory(3, 4, 14, seed=seed)
    prompts = [
        base[int(torch.randint(0, 3, (1,), generator=gen))] + tail
        for tail in prompts_factory(8, 0, 6, seed=seed + 100)
    ]
    lengths = torch.randint(1, 12, (8,), generator=gen).tolist()
    requests = []
    pending = list(zip(prompts, lengths, strict=True))
    while pending or engine.has_unfinished_requests():
        if pending and torch.rand(1, generator=gen) < 0.5:
            prompt, n = pending.pop(0)
            requests.append(engine.add_request(prompt, SamplingParams(num_tokens_to_generate=n, **GREEDY)))
        if torch.rand(1, generator=gen) < 0.1:
            assert engine.suspend() == engine.context.memory_bytes
            assert not engine.context.is_allocated
            engine.step()  # a no-op while suspended
            engine.resume()
        engine.step()
    _check(model, oracle, prompts, requests, lengths)


def test_suspend_resume_keeps_order_and_outputs(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    prompts = prompts_factory(4, 3, 20, seed=10)
    params = SamplingParams(num_tokens_to_generate=8, **GREEDY)
    engine = make_engine(model, blocks=40, max_tokens=12)
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    freed = engine.suspend()
    assert freed == engine.context.memory_bytes > 0
    assert engine.context.kv_cache is None
    paused = [r for r in requests if any(e.type is RequestEventType.PAUSE for e in r.events)]
    assert paused == [r for r in requests if not r.finished]
    assert [r.request_id for r in engine.scheduler.waiting] == [r.request_id for r in paused]
    assert engine.suspend() == 0
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step()
    _check(model, oracle, prompts, requests, [8] * 4)
