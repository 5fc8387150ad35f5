"""Requests stop at the model's end-of-sequence ids by default; ``SamplingParams.ignore_eos`` and
the engine's ``eos_token_id`` override them. Oracles: the full-recompute greedy decode, and Hugging
Face ``generate`` for an imported checkpoint."""

import pytest
import torch
from mcore_inference import SamplingParams

GREEDY = dict(temperature=0.0, num_tokens_to_generate=8)


@pytest.fixture
def decoded(make_model, oracle, prompts_factory):
    """A model, a prompt and the model's 8 greedy tokens after it."""
    model = make_model()
    (prompt,) = prompts_factory(1, 6, 6, seed=70)
    return model, prompt, oracle(model, prompt, 8)


def _until(reference, *stops):
    """``reference`` up to and including its first token among ``stops``."""
    return reference[: min(reference.index(t) for t in stops) + 1]


def test_the_models_eos_stops_generation_unless_ignored(decoded, make_engine):
    model, prompt, reference = decoded
    model.eos_token_ids = (reference[3],)
    default, ignoring = make_engine(model).generate(
        [prompt] * 2, [SamplingParams(**GREEDY), SamplingParams(ignore_eos=True, **GREEDY)]
    )
    assert (default.generated_tokens, default.finish_reason) == (_until(reference, reference[3]), "eos")
    assert (ignoring.generated_tokens, ignoring.finish_reason) == (reference, "length")


def test_every_eos_of_a_list_stops(decoded, make_engine):
    model, prompt, reference = decoded
    model.eos_token_ids = (reference[5], reference[2])
    (request,) = make_engine(model).generate([prompt], SamplingParams(**GREEDY))
    assert request.generated_tokens == _until(reference, reference[5], reference[2])


class _Tokenizer:
    def __init__(self, eod_id):
        self.eod_id = eod_id

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def test_the_engines_eos_token_id_overrides_the_models(decoded, make_engine):
    model, prompt, reference = decoded
    model.eos_token_ids = (reference[3],)
    cases = {
        "engine": (dict(eos_token_id=reference[1]), _until(reference, reference[1])),
        "none": (dict(eos_token_id=[]), reference),
        "model over tokenizer": (dict(tokenizer=_Tokenizer(reference[1])), _until(reference, reference[3])),
    }
    for name, (arguments, expected) in cases.items():
        (request,) = make_engine(model, **arguments).generate([prompt], SamplingParams(**GREEDY))
        assert request.generated_tokens == expected, name
    model.eos_token_ids = ()
    (request,) = make_engine(model, tokenizer=_Tokenizer(reference[1])).generate(
        [prompt], SamplingParams(**GREEDY)
    )
    assert request.generated_tokens == _until(reference, reference[1])  # the tokenizer's, lacking the model's


@pytest.mark.parametrize(
    "source, arguments, bad",
    [
        ("the model's eos_token_ids", {}, "vocab_size"),
        ("eos_token_id", dict(eos_token_id=-1), "-1"),
        ("eos_token_id", dict(eos_token_id=[3, True]), "True"),
        ("the tokenizer's eod_id", dict(tokenizer=_Tokenizer(10**6)), "1000000"),
    ],
)
def test_eos_ids_outside_the_vocabulary_are_refused(make_model, make_engine, source, arguments, bad):
    model = make_model()
    vocab = model.vocab_size
    model.eos_token_ids = (vocab,) if bad == "vocab_size" else ()
    bad = str(vocab) if bad == "vocab_size" else bad
    with pytest.raises(ValueError, match=rf"{source} must be token ids in \[0, {vocab}\), got \[{bad}\]"):
        make_engine(model, **arguments)
    assert make_engine(model, eos_token_id=[]).eos_token_ids == ()


def test_an_imported_checkpoints_eos_stops_where_hf_generate_does(
    groups, tmp_path, make_engine, hf_tiny_config
):
    transformers = pytest.importorskip("transformers")
    from mcore_models import import_hf_checkpoint

    config = transformers.LlamaConfig(**hf_tiny_config)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 17, 3, 99, 42, 8]])
    reference = hf_model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 6:].tolist()
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = reference[3]
    hf_model.save_pretrained(tmp_path)
    expected = hf_model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert expected == _until(reference, reference[3])  # the oracle itself stops at the eos
    model = import_hf_checkpoint(tmp_path, pg_collection=groups)
    (request,) = make_engine(model).generate([prompt[0].tolist()], SamplingParams(**GREEDY))
    assert (request.generated_tokens, request.finish_reason) == (expected, "eos")
