"""The engine on pipeline stages, alone and with tensor parallelism: greedy outputs equal the
full-recompute oracle of the unsplit model, and every rank's requests hold the same results."""

import pytest
import torch
from mcore_inference import RequestEventType, RequestStatus, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _results(request):
    """``request.to_dict()`` without its timestamps and sampling seed."""
    data = request.to_dict()
    data["sampling_params"].pop("seed")
    for key in ("token_timestamps", "time_to_first_token"):
        data.pop(key)
    data["events"] = [(e["type"], e["message"]) for e in data["events"]]
    return data


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_stages_match_oracle(
    run_distributed, split_model_builder, make_engine, oracle, prompts_factory, tp, pp
):
    def body():
        import torch.distributed as dist

        rank = dist.get_rank()
        model, whole = split_model_builder(tp=tp, pp=pp)
        prompts = prompts_factory(5, 2, 20, seed=40)  # up to 20 tokens: chunked to max_tokens=10
        # A small cache (preemption), a different budget on every rank.
        engine = make_engine(model, blocks=12 + rank, max_tokens=10)
        greedy = SamplingParams(num_tokens_to_generate=6, **GREEDY)
        scored = SamplingParams(
            num_tokens_to_generate=3, prompt_logprobs=True, logprobs=True, top_n_logprobs=2, **GREEDY
        )
        seeded = SamplingParams(temperature=1.0, seed=rank, num_tokens_to_generate=6, logprobs=True)
        requests = [engine.add_request(p, greedy) for p in prompts]
        requests += [engine.add_request(prompts[1], scored), engine.add_request(prompts[0], seeded)]
        for _ in range(4):
            engine.step()
        assert engine.suspend() > 0
        engine.resume()
        while engine.has_unfinished_requests():
            engine.step()
        assert all(r.status is RequestStatus.COMPLETED for r in requests)
        assert engine._pipeline.num_stages == pp and len(model.decoder.layers) == 1
        with torch.no_grad():
            full = torch.log_softmax(whole(torch.tensor([requests[5].tokens[:-1]]))[0], -1)
        with pytest.raises(NotImplementedError, match="cuda_graphs with pipeline stages"):
            make_engine(model, blocks=12, cuda_graphs=True)
        tokens = requests[5].tokens
        expected = [full[i - 1, tokens[i]].item() for i in range(1, len(tokens))]
        return {
            "blocks": engine.context.num_blocks,
            "greedy_equal_oracle": [r.generated_tokens for r in requests[:5]]
            == [oracle(whole, p, 6) for p in prompts],
            "logprob_error": max(
                abs(a - b)
                for a, b in zip(
                    requests[5].prompt_logprobs[1:] + requests[5].generated_logprobs, expected, strict=True
                )
            ),
            "evictions": sum(e.type is RequestEventType.EVICT for r in requests for e in r.events),
            "paused": sum(e.type is RequestEventType.PAUSE for r in requests for e in r.events),
            "results": [_results(r) for r in requests],
        }

    outcomes = run_distributed(body, tp * pp, timeout=120)
    for outcome in outcomes:
        assert outcome["blocks"] == 12  # the minimum over every rank of the replica
        assert outcome["greedy_equal_oracle"]
        assert outcome["logprob_error"] < 1e-4
        assert outcome["evictions"] > 0 and outcome["paused"] > 0
        assert outcome["results"] == outcomes[0]["results"]  # ranks agree, even on seeded sampling


def test_failed_forward_on_one_stage_is_retried_on_every_stage(
    run_distributed, split_model_builder, make_engine, oracle, flaky_model
):
    def body():
        model, whole = split_model_builder(pp=2)
        engine = make_engine(flaky_model(model, failures=1))  # stage 0 fails at step 1, stage 1 at step 2
        (request,) = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(num_tokens_to_generate=4, **GREEDY))
        transient = [e.message for e in request.events if e.type is RequestEventType.ERROR_TRANSIENT]
        return request.generated_tokens == oracle(whole, [1, 2, 3, 4, 5], 4), transient

    (same0, errors0), (same1, errors1) = run_distributed(body, 2, timeout=60)
    assert same0 and same1
    assert errors0 == [
        "RuntimeError: device hiccup",
        "RuntimeError: pipeline stage 1 failed this step's forward",
    ]
    assert errors1 == [
        "RuntimeError: pipeline stage 0 failed this step's forward",
        "RuntimeError: device hiccup",
    ]


class _BuggyStage:
    """Wraps a stage whose ``inference_forward`` has a programming error on ``stage``."""

    def __init__(self, model, stage):
        self.model, self.stage = model, stage

    def __getattr__(self, name):
        return getattr(self.model, name)

    def inference_forward(self, *args, **kwargs):
        if torch.distributed.get_rank() == self.stage:
            raise TypeError("a bug in stage code")
        return self.model.inference_forward(*args, **kwargs)


@pytest.mark.parametrize("buggy_stage", [0, 1])
def test_a_programming_error_on_one_stage_fails_the_step_on_every_stage(
    run_distributed, split_model_builder, make_engine, buggy_stage
):
    def body():
        model, _ = split_model_builder(pp=2)
        engine = make_engine(_BuggyStage(model, buggy_stage))
        request = engine.add_request([1, 2, 3, 4, 5], SamplingParams(num_tokens_to_generate=4, **GREEDY))
        try:
            engine.step()
        except Exception as error:
            raised = f"{type(error).__name__}: {error}"
        else:
            raised = None
        transient = [e for e in request.events if e.type is RequestEventType.ERROR_TRANSIENT]
        return raised, request.status.name, request.error, len(transient)

    outcomes = run_distributed(body, 2, timeout=60)
    other = 1 - buggy_stage
    assert outcomes[buggy_stage] == (
        "TypeError: a bug in stage code",
        "FAILED",
        "TypeError: a bug in stage code",
        0,
    )
    message = f"PipelineStageError: pipeline stage {buggy_stage} failed this step's forward with a non-transient error"
    assert outcomes[other] == (message, "FAILED", message, 0)


def test_a_stage_without_its_pipeline_group_is_refused(groups, model_builder):
    from mcore_inference import DynamicInferenceEngine

    stage = model_builder(groups=groups, post_process=False)
    with pytest.raises(ValueError, match=r"pipeline stage .* pass pg_collection"):
        DynamicInferenceEngine(stage, kv_cache_memory=1 << 20)
