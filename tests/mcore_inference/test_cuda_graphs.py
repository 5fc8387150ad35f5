"""Decode steps padded to static shapes (what CUDA graphs replay): the padding logic on CPU, where
the padded steps run eagerly, and capture plus replay on CUDA (``gpu``-marked, in a forked rank)."""

import pytest
import torch
from mcore_inference import (
    DecodeGraphRunner,
    InferenceBatchDimensions,
    RequestStatus,
    SamplingParams,
    ScheduledChunk,
)
from mcore_inference.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=7, logprobs=True)
CPU_WARNING = "ignore:cuda_graphs needs a CUDA model"


@pytest.mark.filterwarnings(CPU_WARNING)
@pytest.mark.parametrize("variant", ["llama-like", "gpt-like"])
def test_padded_decode_steps_match_the_oracle(make_model, make_engine, oracle, prompts_factory, variant):
    model = make_model(variant)
    prompts = prompts_factory(6, 2, 14, seed=50)
    prompts.append([*prompts[0][:9], 3, 4])  # a prefix-cache hit
    expected = [oracle(model, p, 7) for p in prompts]
    eager = make_engine(model, blocks=18, max_tokens=12).generate(prompts, GREEDY)
    engine = make_engine(model, blocks=18, max_tokens=12, cuda_graphs=True)  # small: preemption
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.suspend()
    engine.resume()
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.status for r in requests] == [RequestStatus.COMPLETED] * len(prompts)
    assert [r.generated_tokens for r in requests] == expected
    for padded, reference in zip(requests, eager, strict=True):
        torch.testing.assert_close(padded.generated_logprobs, reference.generated_logprobs, rtol=0, atol=1e-5)
    runner = engine.graph_runner
    assert any(event.type.value == "evict" for r in requests for event in r.events)
    assert engine.scheduler.prefix_cache_hit_tokens > 0
    # Decode steps ran padded: to 8 rows while 5..7 requests decode, and several key windows.
    assert {rows for rows, _ in runner.steps} >= {4, 8}
    assert len({blocks for _, blocks in runner.steps}) >= 2
    assert runner.num_graphs == 0  # nothing is captured on a CPU


@pytest.mark.filterwarnings(CPU_WARNING)
def test_padded_rows_write_only_the_padding_slot(make_model, make_engine):
    model = make_model()
    engine = make_engine(model, blocks=16, cuda_graphs=True)
    requests = [engine.add_request(p, GREEDY) for p in ([1, 2, 3], [4, 5, 6, 7, 8], [9])]
    engine.step()  # prefill, eagerly
    context = engine.context
    before = context.kv_cache.clone()
    chunks = [ScheduledChunk(r, len(r.tokens) - 1, 1) for r in requests]
    for request in requests:  # owned blocks already cover the next token
        assert context.blocks_needed(len(request.tokens)) <= len(request.block_ids)
    logits, slices = engine.graph_runner.run(chunks)
    assert logits.shape[0] == 4 and slices == [slice(0, 1), slice(1, 2), slice(2, 3)]
    changed = (context.kv_cache != before).flatten(3).any(-1).any(1).any(0).nonzero().flatten().tolist()
    size = context.block_size
    written = sorted(
        r.block_ids[(len(r.tokens) - 1) // size] * size + (len(r.tokens) - 1) % size for r in requests
    )
    assert changed == [*written, context.padding_slot]
    # The real rows' logits are those of the eager step over the same cache.
    context.kv_cache.copy_(before)
    input_ids, position_ids, eager_slices = ModelRunner(model, context).prepare_step(chunks)
    with torch.inference_mode():
        eager = model(input_ids, position_ids=position_ids, inference_context=context)[0]
    torch.testing.assert_close(logits[:3], eager[[s.start for s in eager_slices]], rtol=1e-5, atol=1e-6)


def test_runner_rejects_bad_configurations(make_model, make_engine):
    engine = make_engine(make_model(), blocks=16, max_requests=4)
    model, context = engine.model, engine.context
    with pytest.raises(ValueError, match="no decode-only bucket"):
        DecodeGraphRunner(model, context, [InferenceBatchDimensions(16, 1, 3)], capture=False)
    with pytest.raises(ValueError, match="more requests than max_requests 4"):
        DecodeGraphRunner(model, context, [InferenceBatchDimensions(8, 0, 8)], capture=False)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        DecodeGraphRunner(model, context, [InferenceBatchDimensions(2, 0, 2)], capture=True)
    with pytest.warns(UserWarning, match="cuda_graphs needs a CUDA model"):
        runner = make_engine(engine.model, blocks=16, max_requests=4, cuda_graphs=True).graph_runner
    assert [b.decode_req_count for b in runner.buckets] == [1, 2, 4]


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_match_eager(run_distributed, model_builder, oracle, prompts_factory):
    def body():
        from mcore_inference import DynamicInferenceEngine
        from mcore_parallel import initialize_model_parallel

        model = model_builder(groups=initialize_model_parallel()).cuda()
        prompts = prompts_factory(6, 2, 14, seed=51)
        expected = [oracle(model, p, 7) for p in prompts]

        def run(cuda_graphs):
            engine = DynamicInferenceEngine(
                model, kv_cache_memory=1 << 24, block_size=4, max_tokens=12, cuda_graphs=cuda_graphs
            )
            requests = engine.generate(prompts, GREEDY)
            engine.suspend()  # graphs are dropped with the cache and captured again after
            engine.resume()
            again = engine.generate(prompts[:2], GREEDY)
            return engine, requests + again

        _, eager = run(False)
        engine, graphed = run(True)
        runner = engine.graph_runner
        assert [r.generated_tokens for r in graphed] == expected + expected[:2]
        assert [r.generated_tokens for r in eager] == expected + expected[:2]
        for a, b in zip(graphed, eager, strict=True):
            torch.testing.assert_close(a.generated_logprobs, b.generated_logprobs, rtol=0, atol=1e-4)
        assert runner.num_graphs > 0 and sum(runner.steps.values()) > runner.num_graphs  # replayed
        return True

    assert run_distributed(body, 1, timeout=240, backend="nccl") == [True]
