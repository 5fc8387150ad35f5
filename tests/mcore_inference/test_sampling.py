"""Per-request sampling: filters, seeds, log-probabilities, stop conditions; mixed in one batch."""

import pytest
import torch
from mcore_inference import InvalidRequestError, RequestStatus, SamplingParams, filter_logits, sample

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_filters_apply_temperature_top_k_top_p_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]  # ~[0.64, 0.24, 0.09, 0.03]
    kept = lambda **kw: torch.isfinite(filter_logits(logits, [SamplingParams(**kw)]))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=float(probs[0]) + 0.01) == [True, True, False, False]
    assert kept(top_p=0.01) == [True, False, False, False]
    assert kept(min_p=float(probs[2] / probs[0]) - 0.01) == [True, True, True, False]
    assert kept() == [True] * 4
    torch.testing.assert_close(filter_logits(logits, [SamplingParams(temperature=0.5)]), logits / 0.5)


def test_sample_mixes_greedy_and_seeded_rows_and_reports_untempered_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0, top_n_logprobs=3),
        SamplingParams(temperature=5.0, seed=1, logprobs=True),
        SamplingParams(temperature=1.0, top_k=1, logprobs=True),
    ]
    draw = lambda: sample(logits, params, torch.Generator())  # noqa: E731
    out = draw()
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == int(logits[2].argmax())
    assert draw().tokens == out.tokens  # the seeded row repeats
    reference = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([float(reference[i, t]) for i, t in enumerate(out.tokens)], abs=1e-6)
    top = reference[0].topk(3)
    assert out.top_logprobs[0] == pytest.approx(
        dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    )
    assert out.top_logprobs[1] == {}


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(top_k=3)]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[sample(logits, params, generator).tokens[0]] += 1
    torch.testing.assert_close(counts / 2000, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.04, rtol=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_k", 1000),
        ("top_p", 0.0),
        ("min_p", 1.5),
        ("num_tokens_to_generate", -1),
        ("top_n_logprobs", -2),
        ("stop_token_ids", [500]),
        ("seed", -3),
    ],
)
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value}).validate(vocab_size=128)
    assert info.value.field == field


def test_seeded_requests_reproduce_whatever_their_batch(make_model, make_engine, prompts_factory):
    model = make_model()
    prompts = prompts_factory(4, 3, 10, seed=20)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, num_tokens_to_generate=10, ignore_eos=True)
    alone = make_engine(model).generate(prompts[:1], seeded)[0].generated_tokens
    mixed = make_engine(model, max_tokens=8).generate(
        prompts,
        [seeded, SamplingParams(temperature=0.7, seed=5), SamplingParams(**GREEDY), SamplingParams(top_k=3)],
    )
    assert mixed[0].generated_tokens == alone
    other_seed = make_engine(model).generate(
        prompts[:1], SamplingParams(temperature=1.0, seed=124, num_tokens_to_generate=10)
    )
    assert other_seed[0].generated_tokens != alone


def _full_logprobs(model, tokens):
    model.parallel_output = False
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens]))[0].float(), -1)


@pytest.mark.parametrize("max_tokens", [64, 5])
def test_logprobs_and_prompt_logprobs_match_the_full_forward(
    make_model, make_engine, prompts_factory, max_tokens
):
    model = make_model()
    prompts = prompts_factory(3, 2, 17, seed=21)
    params = SamplingParams(
        num_tokens_to_generate=5, logprobs=True, top_n_logprobs=2, prompt_logprobs=True, **GREEDY
    )
    engine = make_engine(model, blocks=64, max_tokens=max_tokens)
    requests = engine.generate([prompts[0], *prompts], params)  # a repeated prompt: no prefix-cache shortcut
    for request in requests:
        full = _full_logprobs(model, request.tokens[:-1])
        n = len(request.prompt_tokens)
        expected_prompt = [full[i - 1, request.tokens[i]].item() for i in range(1, n)]
        assert request.prompt_logprobs[0] is None
        assert request.prompt_logprobs[1:] == pytest.approx(expected_prompt, abs=1e-4)
        assert request.prompt_top_logprobs[0] is None and len(request.prompt_top_logprobs) == n
        for i in range(1, n):  # each prompt position's two most likely tokens, best first
            best = full[i - 1].topk(2)
            assert list(request.prompt_top_logprobs[i]) == best.indices.tolist()
            assert list(request.prompt_top_logprobs[i].values()) == pytest.approx(
                best.values.tolist(), abs=1e-4
            )
        expected = [full[n - 1 + j, t].item() for j, t in enumerate(request.generated_tokens)]
        assert request.generated_logprobs == pytest.approx(expected, abs=1e-4)
        top = full[n - 1].topk(2)
        assert list(request.generated_top_logprobs[0]) == top.indices.tolist()


def test_stop_tokens_eos_and_total_length(make_model, make_engine, oracle, prompts_factory):
    model = make_model()
    (prompt,) = prompts_factory(1, 6, 6, seed=22)
    reference = oracle(model, prompt, 8)
    stop = reference[3]
    cut = reference.index(stop) + 1
    engine = make_engine(model, eos_token_id=stop)
    by_stop, by_eos, ignoring, total = engine.generate(
        [prompt] * 4,
        [
            SamplingParams(temperature=0.0, stop_token_ids=[stop], ignore_eos=True, num_tokens_to_generate=8),
            SamplingParams(temperature=0.0, num_tokens_to_generate=8),
            SamplingParams(**GREEDY, num_tokens_to_generate=8),
            SamplingParams(**GREEDY, num_tokens_to_generate=None, num_tokens_total=9),
        ],
    )
    assert (by_stop.generated_tokens, by_stop.finish_reason) == (reference[:cut], "stop_token")
    assert (by_eos.generated_tokens, by_eos.finish_reason) == (reference[:cut], "eos")
    assert (ignoring.generated_tokens, ignoring.finish_reason) == (reference, "length")
    assert (total.generated_tokens, total.finish_reason) == (reference[:3], "length")


class LetterTokenizer:
    """Token ``t`` is the letter ``chr(97 + t % 26)``."""

    eod_id = None

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, tokens):
        return "".join(chr(97 + t % 26) for t in tokens)


def test_text_prompts_and_stop_strings(make_model, make_engine, oracle):
    model = make_model()
    tokenizer = LetterTokenizer()
    reference = oracle(model, tokenizer.encode("hello"), 10)
    text = tokenizer.decode(reference)
    stop = text[4:6]
    engine = make_engine(model, tokenizer=tokenizer)
    (request,) = engine.generate(
        ["hello"], SamplingParams(stop_strings=[stop], num_tokens_to_generate=10, **GREEDY)
    )
    assert request.status is RequestStatus.COMPLETED and request.finish_reason == "stop_string"
    assert request.generated_text == text[: text.find(stop)]
    assert request.prompt_text == "hello" and request.prompt_tokens == tokenizer.encode("hello")
    (plain,) = engine.generate(["hello"], SamplingParams(num_tokens_to_generate=10, **GREEDY))
    assert plain.generated_text == text
