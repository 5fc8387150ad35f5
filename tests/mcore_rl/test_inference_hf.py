"""``HFHandle`` on a tiny random-weight Hugging Face Llama (vocabulary 128, character tokenizer):
greedy completions equal ``model.generate(do_sample=False)``; every returned log-probability equals
``log_softmax`` of the model's logits recomputed over prompt + completion; seeded samples repeat;
stop strings, end-of-sequence and bad input behave as documented."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mcore_models.data import Tokenizer  # noqa: E402
from mcore_rl.inference import (  # noqa: E402
    GenerationError,
    HFHandle,
    VocabularyMismatchError,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "mcore_inference"))
from serve_process import write_tiny_hf_model  # noqa: E402

PROMPTS = ["12+34=", [ord(c) for c in "def fib(n):"], "a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("hf-handle") / "tiny-llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def handle(hf_model, model_dir):
    return HFHandle(hf_model, Tokenizer.from_file(model_dir / "tokenizer.json"))


def recomputed_logprobs(model, prompt_ids, completion_ids):
    """The oracle: log_softmax of the logits of one full forward over prompt + completion."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logprobs[rows, ids[0, rows + 1]].tolist()


def test_greedy_equals_hf_generate_and_logprobs_equal_recomputed(handle, hf_model):
    generations = handle.generate(PROMPTS, temperature=0, max_tokens=12)
    assert len(generations) == len(PROMPTS)
    for index, generation in enumerate(generations):
        prompt = generation.prompt_ids
        assert generation.prompt_index == index and generation.sample_index == 0
        output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[
            0, len(prompt) :
        ]
        expected = output.tolist()
        if 0 in expected:  # generate pads after the end-of-sequence id (0); the handle stops at it
            expected = expected[: expected.index(0) + 1]
        assert generation.completion_ids == expected
        assert generation.finish_reason == ("stop" if expected[-1] == 0 else "length")
        assert generation.logprobs == pytest.approx(
            recomputed_logprobs(hf_model, prompt, generation.completion_ids), abs=1e-5
        )
        assert generation.text == "".join(chr(t) if t else "<|endoftext|>" for t in generation.completion_ids)


def test_samples_logprobs_are_the_models_before_temperature(handle, hf_model):
    generations = handle.generate(
        PROMPTS[:2], n=3, temperature=1.5, top_k=20, top_p=0.9, seed=7, max_tokens=8
    )
    assert [(g.prompt_index, g.sample_index) for g in generations] == [
        (i, j) for i in range(2) for j in range(3)
    ]
    for generation in generations:
        assert len(generation.logprobs) == len(generation.completion_ids)
        assert generation.logprobs == pytest.approx(
            recomputed_logprobs(hf_model, generation.prompt_ids, generation.completion_ids), abs=1e-5
        )
    again = handle.generate(PROMPTS[:2], n=3, temperature=1.5, top_k=20, top_p=0.9, seed=7, max_tokens=8)
    assert [g.completion_ids for g in again] == [g.completion_ids for g in generations]
    assert len({tuple(g.completion_ids) for g in generations[:3]}) > 1  # samples of a prompt differ


def test_ignore_eos_and_stop_strings(handle):
    (free,) = handle.generate(["12+34="], temperature=0, max_tokens=12, ignore_eos=True)
    assert len(free.completion_ids) == 12 and free.finish_reason == "length"
    stop = free.text[3:5]  # a piece of the greedy text: it must cut the text there
    (cut,) = handle.generate(["12+34="], temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.completion_ids == free.completion_ids[: len(cut.completion_ids)]
    assert stop in handle.tokenizer.decode(cut.completion_ids)  # the tokens that completed it are kept


def test_bad_input_is_refused_naming_it(handle, hf_model):
    with pytest.raises(ValueError, match="temperature"):
        handle.generate(["1+1="], temperature=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beams'"):
        handle.generate(["1+1="], beams=2)
    with pytest.raises(ValueError, match=r"prompts\[1\]: must hold at least one token"):
        handle.generate(["1+1=", []])
    with pytest.raises(TypeError, match="wrap it in a list"):
        handle.generate([1, 2, 3])
    with pytest.raises(GenerationError, match="prompt 0: token id 500"):
        handle.generate([[1, 500]])
    with pytest.raises(ValueError, match="text prompt needs a handle with a tokenizer"):
        HFHandle(hf_model).generate(["1+1="])
    with pytest.raises(ValueError, match="training mode"):
        HFHandle(hf_model.train())
    hf_model.eval()


def test_a_tokenizer_larger_than_the_model_is_refused(model_dir):
    config = transformers.LlamaConfig.from_pretrained(model_dir)
    config.vocab_size = 64  # fewer embedding rows than the 128-id tokenizer
    small = transformers.LlamaForCausalLM(config).eval()
    with pytest.raises(VocabularyMismatchError, match=r"128 ids but the model .* has 64 embedding rows"):
        HFHandle(small, Tokenizer.from_file(model_dir / "tokenizer.json"))
