"""``TensorParallelLeader`` and ``follow_leader`` on two gloo ranks splitting the conftest model:
what is done to rank 0's engine only (adds, a refused add, an abort, steps, suspend and resume,
shutdown) is repeated on rank 1's, so both step in lockstep and finish with the same requests.
Oracle: the full-recompute greedy decode of the whole model on one process."""

import torch.distributed as dist
from mcore_inference import RequestStatus, SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=5)


def _body(prompts, split_model_builder, make_engine, oracle):
    from mcore_inference.tensor_parallel_engine import TensorParallelLeader, follow_leader

    model, whole = split_model_builder(tp=2)
    engine = make_engine(model, blocks=32, max_tokens=8)  # chunked prefill
    control = dist.new_group(backend="gloo")
    if dist.get_rank() > 0:
        follow_leader(engine, control)
        return engine.step_count, engine.cache_stats()
    leader = TensorParallelLeader(engine, control)
    requests = [leader.add_request(p, GREEDY) for p in prompts]
    refused = leader.add_request([10_000], GREEDY)  # out of the vocabulary: fails alone, id used
    leader.step()
    leader.abort(requests[1].request_id)
    leader.suspend()
    leader.resume()
    late = leader.add_request(prompts[0], GREEDY)
    while leader.has_unfinished_requests():
        leader.step()
    leader.shutdown()
    expected = [oracle(whole, p, 5) for p in prompts]
    return (
        engine.step_count,
        engine.cache_stats(),
        [r.status for r in [*requests, refused, late]],
        [r.generated_tokens for r in [requests[0], requests[2], late]],
        [expected[0], expected[2], expected[0]],
    )


def test_follower_repeats_every_call_of_the_leader(run_distributed, split_model_builder, make_engine, oracle):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    leader, follower = run_distributed(
        _body, 2, prompts, split_model_builder, make_engine, oracle, timeout=120
    )
    steps, stats, statuses, tokens, expected = leader
    assert (steps, stats) == follower and steps > 3
    done, aborted, failed = RequestStatus.COMPLETED, RequestStatus.ABORTED, RequestStatus.FAILED
    assert statuses == [done, aborted, done, failed, done]
    assert tokens == expected
