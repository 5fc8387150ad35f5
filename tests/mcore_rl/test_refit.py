"""``refit``: a trainer model's weights copied into a live engine's model in place. Oracles: the
trainer model's own forward (prompt log-probabilities, full-recompute greedy tokens), and for a
bfloat16 engine (with CPU weight packing) a fresh engine built on the trainer's weights cast to
bfloat16. Tensor-parallel trainers and engines run on two gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from mcore_inference import DynamicInferenceEngine, SamplingParams
from mcore_models import GPTModel
from mcore_parallel import ProcessGroupCollection, set_cpu_weight_packing
from mcore_rl import EngineBusyError, RefitMismatchError, refit
from mcore_testing.tiny_llama import tiny_llama_config

VOCAB = 100  # padded to 100 rows at TP 1, 104 at TP 2 (make_vocab_size_divisible_by=4)
LLAMA = dict(hidden_size=64, ffn_hidden_size=96, make_vocab_size_divisible_by=4)
PROMPTS = [[5, 17, 42, 8, 99, 3, 61, 20, 7], [11, 2, 73]]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=4)
SCORED = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=4, prompt_logprobs=True)


def build_model(groups, seed, tp=1, vocab=VOCAB, **overrides):
    config = tiny_llama_config(tensor_model_parallel_size=tp, **(LLAMA | overrides))
    torch.manual_seed(seed)
    return GPTModel(config, vocab, pg_collection=groups).eval()


def build_engine(model, block_size=4, blocks=64):
    spec = model.kv_cache_spec
    per_block = 2 * len(spec.layer_numbers) * block_size * spec.num_kv_heads * spec.head_dim * 4
    return DynamicInferenceEngine(model, kv_cache_memory=blocks * per_block, block_size=block_size)


def trainer_logprobs(model, prompt):
    """Log-probability of each prompt token after the first under ``model`` (whole logits)."""
    model.parallel_output = False
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)


def greedy_oracle(model, prompt, count=4):
    """Full-recompute greedy decode of ``count`` tokens."""
    tokens = list(prompt)
    model.parallel_output = False
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def engine_outputs(engine, params=SCORED):
    """``(prompt log-probabilities, generated tokens)`` of ``PROMPTS``."""
    requests = engine.generate(PROMPTS, params)
    logprobs = [torch.tensor(r.prompt_logprobs[1:]) for r in requests] if params.prompt_logprobs else None
    return logprobs, [r.generated_tokens for r in requests]


def assert_engine_runs(engine, trainer):
    """The engine scores and greedily continues ``PROMPTS`` as ``trainer`` does."""
    logprobs, tokens = engine_outputs(engine)
    for got, prompt in zip(logprobs, PROMPTS, strict=True):
        torch.testing.assert_close(got, trainer_logprobs(trainer, prompt), atol=1e-4, rtol=1e-4)
    assert tokens == [greedy_oracle(trainer, p) for p in PROMPTS]


def sgd_step(model, seed=0, lr=2.0):
    """One optimizer step of ``model`` on random tokens."""
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.parallel_output = True
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture
def groups():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessGroupCollection(tp=dist.new_group([0]))
    dist.destroy_process_group()


def test_refit_after_an_optimizer_step_gives_the_trainers_outputs(groups):
    trainer = build_model(groups, seed=0)
    engine = build_engine(build_model(groups, seed=0))
    before_logprobs, _ = engine_outputs(engine)
    sgd_step(trainer)
    assert (before_logprobs[0] - trainer_logprobs(trainer, PROMPTS[0])).abs().max() > 1e-2  # it moved
    pointers = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    assert refit(trainer, engine) == 1 == engine.weight_version
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == pointers  # in place
    assert_engine_runs(engine, trainer)
    sgd_step(trainer, seed=1)
    assert refit(trainer, engine) == 2
    assert_engine_runs(engine, trainer)


def test_bfloat16_engine_with_packed_weights_equals_a_fresh_engine_on_the_cast_weights(groups):
    trainer = build_model(groups, seed=1)
    engine_model = build_model(groups, seed=0).to(torch.bfloat16)
    set_cpu_weight_packing(engine_model, True)
    engine = build_engine(engine_model)
    stale = engine_outputs(engine)  # packs the old weights
    refit(trainer, engine)
    for name, p in engine_model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, trainer.get_parameter(name).to(torch.bfloat16)), name
    cast = build_model(groups, seed=2)
    cast.load_state_dict(trainer.state_dict())
    cast.to(torch.bfloat16)
    set_cpu_weight_packing(cast, True)
    expected = engine_outputs(build_engine(cast))
    got = engine_outputs(engine)
    assert got[1] == expected[1] and got[1] != stale[1]
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_prompts_cached_before_the_refit_are_computed_again(groups):
    trainer = build_model(groups, seed=1)
    engine = build_engine(build_model(groups, seed=0))
    prompt = PROMPTS[0]  # two full blocks of 4
    old = engine.generate([prompt], GREEDY)[0].generated_tokens
    engine.generate([prompt], GREEDY)
    hits = engine.cache_stats()["prefix_cache_hit_tokens"]
    assert hits == 8  # the second run read the first one's two blocks
    refit(trainer, engine)
    new = engine.generate([prompt], GREEDY)[0].generated_tokens
    assert engine.cache_stats()["prefix_cache_hit_tokens"] == hits  # no stale hit
    assert new == greedy_oracle(trainer, prompt) != old
    engine.generate([prompt], GREEDY)  # the new weights' blocks are cached again
    assert engine.cache_stats()["prefix_cache_hit_tokens"] == hits + 8


def test_refit_is_refused_while_requests_are_unfinished(groups):
    trainer = build_model(groups, seed=1)
    engine = build_engine(build_model(groups, seed=0))
    weights = snapshot(engine.model)
    request = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError, match="unfinished requests"):
        refit(trainer, engine)
    engine.step()  # one step in: still running
    engine.suspend()  # kept by suspend: still unfinished
    with pytest.raises(EngineBusyError):
        refit(trainer, engine)
    assert engine.weight_version == 0
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())
    engine.resume()
    while not request.finished:
        engine.step()
    assert refit(trainer, engine) == 1


@pytest.mark.parametrize(
    ("overrides", "vocab", "message"),
    [
        (dict(num_layers=3), VOCAB, r"only the trainer has \['decoder.layers.2"),
        (
            dict(ffn_hidden_size=128),
            VOCAB,
            r"decoder.layers.0.mlp.linear_fc1.weight: the trainer's full shape \[256, 64\]",
        ),
        (dict(num_query_groups=4), VOCAB, r"decoder.layers.0.self_attention.linear_qkv.weight"),
        ({}, 96, r"embedding.word_embeddings.weight: the trainer's full shape \[96, 64\]"),
    ],
)
def test_mismatched_models_are_refused_naming_the_tensor(groups, overrides, vocab, message):
    trainer = build_model(groups, seed=1, vocab=vocab, **overrides)
    engine = build_engine(build_model(groups, seed=0))
    weights = snapshot(engine.model)
    with pytest.raises(RefitMismatchError, match=message):
        refit(trainer, engine)
    assert engine.weight_version == 0
    assert all(torch.equal(p, weights[n]) for n, p in engine.model.named_parameters())


def test_an_engine_of_another_type_is_refused(groups):
    with pytest.raises(TypeError, match="engine: must be a DynamicInferenceEngine"):
        refit(build_model(groups, seed=0), build_model(groups, seed=0))


def test_suspend_train_refit_resume_generates_with_the_new_weights(groups):
    trainer = build_model(groups, seed=0)
    engine = build_engine(build_model(groups, seed=0))
    engine_outputs(engine)  # a rollout: fills the prefix cache
    assert engine.suspend() > 0  # the KV cache freed for training
    sgd_step(trainer)
    assert refit(trainer, engine) == 1
    engine.resume()
    assert_engine_runs(engine, trainer)


def _refit_across(trainer_tp, engine_tp, engine_ranks):
    """On 2 ranks: a trainer at ``trainer_tp`` refits engines at ``engine_tp`` on ``engine_ranks``;
    the engines' outputs and the trainer's (collective where it is split)."""
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(2)]
    both = dist.new_group([0, 1])

    def groups(tp):
        return ProcessGroupCollection(tp=both if tp == 2 else singles[rank])

    trainer = build_model(groups(trainer_tp), seed=1, tp=trainer_tp)
    engine = (
        build_engine(build_model(groups(engine_tp), seed=0, tp=engine_tp)) if rank in engine_ranks else None
    )
    version = refit(trainer, engine)
    expected = ([trainer_logprobs(trainer, p) for p in PROMPTS], [greedy_oracle(trainer, p) for p in PROMPTS])
    return version, expected, None if engine is None else engine_outputs(engine)


@pytest.mark.parametrize(
    ("trainer_tp", "engine_tp", "engine_ranks"),
    [(2, 1, (0,)), (2, 1, (0, 1)), (1, 2, (0, 1)), (2, 2, (0, 1))],
)
def test_refit_across_tensor_parallel_sizes(run_distributed, trainer_tp, engine_tp, engine_ranks):
    results = run_distributed(_refit_across, 2, trainer_tp, engine_tp, engine_ranks, timeout=120)
    for rank, (version, (logprobs, tokens), outputs) in enumerate(results):
        if rank not in engine_ranks:
            assert version is None and outputs is None
            continue
        assert version == 1
        got_logprobs, got_tokens = outputs
        assert got_tokens == tokens
        for got, want in zip(got_logprobs, logprobs, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _busy_on_one_rank():
    """Trainer at TP 2; rank 0's engine is busy, rank 1 has none: both refuse, neither hangs."""
    both = dist.new_group([0, 1])
    trainer = build_model(ProcessGroupCollection(tp=both), seed=1, tp=2)
    engine = None
    if dist.get_rank() == 0:
        engine = build_engine(build_model(ProcessGroupCollection(tp=dist.new_group([0])), seed=0))
        engine.add_request(PROMPTS[0], GREEDY)
    else:
        dist.new_group([0])  # every rank takes part in creating a group
    try:
        refit(trainer, engine)
    except EngineBusyError as error:
        return str(error)
    return None


def test_a_refusal_on_one_rank_is_raised_on_every_rank(run_distributed):
    leader, other = run_distributed(_busy_on_one_rank, 2, timeout=60)
    assert "unfinished requests" in leader
    assert other.startswith("refused on another rank") and "unfinished requests" in other
