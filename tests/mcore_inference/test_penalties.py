"""Presence, frequency and repetition penalties: hand-computed values, a plain per-row reference,
their place before temperature and filters, validation, and the engine against a full-recompute
penalised greedy decode."""

import pytest
import torch
from mcore_inference import InvalidRequestError, SamplingParams, sample
from mcore_inference.penalties import apply_penalties, token_counts


def reference_penalties(logits, prompt, output, params):
    """One row's penalised logits, written plainly (vLLM's order: repetition, frequency, presence)."""
    values = logits.tolist()
    for token in range(len(values)):
        if token in prompt or token in output:
            r = params.repetition_penalty
            values[token] = values[token] / r if values[token] > 0 else values[token] * r
        values[token] -= params.frequency_penalty * output.count(token)
        values[token] -= params.presence_penalty * (token in output)
    return torch.tensor(values)


def test_hand_computed_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0]])
    prompt, output = [1], [0, 0, 2]
    counts = token_counts([output], 5, logits.device)
    assert counts.tolist() == [[2.0, 0.0, 1.0, 0.0, 0.0]]
    prompt_mask = token_counts([prompt], 5, logits.device) > 0
    penalised = apply_penalties(
        logits, counts, prompt_mask, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    )
    # repetition (tokens 0, 1, 2 seen): [1.0, -2.0, 0.25, 0.0, 1.0]
    # frequency 0.25 x [2, 0, 1, 0, 0]: [0.5, -2.0, 0.0, 0.0, 1.0]; presence 0.5 on tokens 0, 2
    assert penalised.tolist() == [[0.0, -2.0, -0.5, 0.0, 1.0]]
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    assert sample(logits, [params], prompt_tokens=[prompt], output_tokens=[output]).tokens == [4]
    plain = SamplingParams(temperature=0.0)
    assert sample(logits, [plain], prompt_tokens=[prompt], output_tokens=[output]).tokens == [0]


def test_negative_penalties_encourage_and_the_prompt_counts_only_for_repetition():
    logits = torch.tensor([[1.0, 0.9, -0.5]])
    prompt, output = [1], []
    for params, expected in [
        (SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=-2.0), 0),  # no output
        (SamplingParams(temperature=0.0, repetition_penalty=0.5), 1),  # 0.9 / 0.5 = 1.8
        (SamplingParams(temperature=0.0, repetition_penalty=2.0), 0),
    ]:
        assert sample(logits, [params], prompt_tokens=[prompt], output_tokens=[output]).tokens == [expected]
    boost = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    assert sample(logits, [boost], prompt_tokens=[prompt], output_tokens=[[2]]).tokens == [
        2
    ]  # -0.5 + 2 = 1.5


def test_batched_penalties_match_the_per_row_reference():
    generator = torch.Generator().manual_seed(8)
    rows, vocab = 24, 30
    logits = torch.randn(rows, vocab, generator=generator) * 3
    params, prompts, outputs = [], [], []
    for i in range(rows):
        params.append(
            SamplingParams(
                temperature=0.0,
                presence_penalty=[0.0, 1.5, -0.7][i % 3],
                frequency_penalty=[0.0, 0.4, -2.0, 2.0][i % 4],
                repetition_penalty=[1.0, 1.3, 0.6, 1.0, 2.0][i % 5],
            )
        )
        prompts.append(torch.randint(0, vocab, (i % 6 + 1,), generator=generator).tolist())
        outputs.append(torch.randint(0, vocab, (i % 9,), generator=generator).tolist())
    expected = torch.stack(
        [reference_penalties(logits[i], prompts[i], outputs[i], params[i]) for i in range(rows)]
    )
    counts = token_counts(outputs, vocab, logits.device)
    prompt_mask = token_counts(prompts, vocab, logits.device) > 0
    columns = [
        torch.tensor([getattr(p, name) for p in params])
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    ]
    torch.testing.assert_close(apply_penalties(logits, counts, prompt_mask, *columns), expected)
    out = sample(logits, params, prompt_tokens=prompts, output_tokens=outputs)
    assert out.tokens == expected.argmax(-1).tolist()


def test_penalties_apply_before_temperature_and_filters_and_leave_logprobs_alone():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]] * 3)
    output = [[0], [0], [0]]
    params = [
        SamplingParams(temperature=0.01, frequency_penalty=1.0, seed=1, logprobs=True),  # 2.0 < 2.5
        SamplingParams(top_k=1, temperature=5.0, presence_penalty=1.0, seed=2),  # top-1 after penalty
        SamplingParams(top_k=1, temperature=5.0, seed=3),  # without a penalty: token 0
    ]
    out = sample(logits, params, torch.Generator(), prompt_tokens=[[]] * 3, output_tokens=output)
    assert out.tokens == [1, 1, 0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]), abs=1e-6)


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
    ],
)
def test_invalid_penalties_name_their_field(field, value):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value}).validate(vocab_size=128)
    assert info.value.field == field


def test_valid_penalties_at_their_bounds():
    for value in (-2.0, 2.0):
        SamplingParams(presence_penalty=value, frequency_penalty=value).validate(vocab_size=128)
    SamplingParams(repetition_penalty=1e-3).validate(vocab_size=128)
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


def penalised_greedy_oracle(model, prompt, num_tokens, params):
    """Full-recompute greedy decode with the reference penalties applied to every step's logits."""
    tokens = list(prompt)
    parallel_output, model.parallel_output = model.parallel_output, False
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([tokens]))[0, -1].float()
            penalised = reference_penalties(logits, prompt, tokens[len(prompt) :], params)
            tokens.append(int(penalised.argmax()))
    model.parallel_output = parallel_output
    return tokens[len(prompt) :]


def test_engine_penalised_greedy_matches_the_full_recompute(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    prompts = prompts_factory(3, 4, 12, seed=30)
    penalised = [
        SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=16, repetition_penalty=3.0),
        SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            num_tokens_to_generate=16,
            frequency_penalty=2.0,
            presence_penalty=1.0,
        ),
    ]
    plain = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=16)
    requests = make_engine(model, max_tokens=8).generate(prompts, [*penalised, plain])
    for request, prompt, params in zip(requests[:2], prompts[:2], penalised, strict=True):
        assert request.generated_tokens == penalised_greedy_oracle(model, prompt, 16, params)
        assert request.generated_tokens != oracle(model, prompt, 16)  # the penalties changed something
    assert requests[2].generated_tokens == oracle(model, prompts[2], 16)
