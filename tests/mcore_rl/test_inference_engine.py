"""``EngineHandle`` over the in-process engine serving a tiny Hugging Face Llama imported with
mcore-models: greedy tokens equal ``HFHandle``'s on the same weights, seeded samples too (both draw
with ``mcore_inference.sample``), log-probabilities equal ``log_softmax`` of the Hugging Face
model's logits recomputed over prompt + completion (float32, within 1e-4); a failed prompt and a
mismatched tokenizer are refused."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mcore_inference import DynamicInferenceEngine  # noqa: E402
from mcore_models import load_checkpoint_for_inference  # noqa: E402
from mcore_rl.inference import (  # noqa: E402
    EngineHandle,
    GenerationError,
    HFHandle,
    VocabularyMismatchError,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "mcore_inference"))
from serve_process import KV_CACHE_BYTES, write_tiny_hf_model  # noqa: E402
from server_stack import write_char_tokenizer  # noqa: E402

PROMPTS = ["12+34=", [ord(c) for c in "def fib(n):"], "import os\n"]
TOLERANCE = 1e-4  # float32: the engine's paged attention against one Hugging Face forward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("engine-handle") / "tiny-llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def engine_of(model_dir):
    loaded = load_checkpoint_for_inference(model_dir)
    return DynamicInferenceEngine(
        loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=KV_CACHE_BYTES, freeze_gc=False
    )


@pytest.fixture(scope="module")
def handles(model_dir, hf_model):
    engine = engine_of(model_dir)
    return EngineHandle(engine), HFHandle(hf_model, engine.tokenizer)


def recomputed_logprobs(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logprobs[rows, ids[0, rows + 1]].tolist()


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0, max_tokens=10),
        dict(n=3, temperature=1.0, top_k=30, top_p=0.95, seed=11, max_tokens=10),
    ],
    ids=["greedy", "seeded"],
)
def test_engine_equals_hf_on_the_same_weights(handles, hf_model, sampling):
    engine_handle, hf_handle = handles
    generations = engine_handle.generate(PROMPTS, **sampling)
    expected = hf_handle.generate(PROMPTS, **sampling)
    assert [g.completion_ids for g in generations] == [g.completion_ids for g in expected]
    assert [(g.prompt_index, g.sample_index, g.finish_reason) for g in generations] == [
        (g.prompt_index, g.sample_index, g.finish_reason) for g in expected
    ]
    assert [g.text for g in generations] == [g.text for g in expected]
    for generation in generations:
        assert generation.logprobs == pytest.approx(
            recomputed_logprobs(hf_model, generation.prompt_ids, generation.completion_ids), abs=TOLERANCE
        )


@pytest.mark.parametrize("which", ["engine", "hf"])
def test_every_prompt_of_a_seeded_call_has_its_own_streams(handles, which):
    """Sample ``j`` of prompt ``i`` draws with ``seed + i * n + j``: the same prompt twice in one
    call gives different samples, each equal to a one-prompt call with its seed."""
    handle = dict(zip(("engine", "hf"), handles, strict=True))[which]
    options = dict(n=2, temperature=1.0, max_tokens=10, ignore_eos=True)
    twice = handle.generate(["12+34=", "12+34="], seed=7, **options)
    first, second = (
        handle.generate(["12+34="], seed=7, **options),
        handle.generate(["12+34="], seed=9, **options),
    )
    assert [g.completion_ids for g in twice] == [g.completion_ids for g in first + second]
    assert [g.prompt_index for g in twice] == [0, 0, 1, 1]
    assert twice[0].completion_ids != twice[2].completion_ids


def test_stop_strings_cut_the_text(handles):
    engine_handle, hf_handle = handles
    (free,) = engine_handle.generate(["12+34="], temperature=0, max_tokens=10, ignore_eos=True)
    stop = free.text[2:4]
    (cut,) = engine_handle.generate(["12+34="], temperature=0, max_tokens=10, ignore_eos=True, stop=stop)
    (hf_cut,) = hf_handle.generate(["12+34="], temperature=0, max_tokens=10, ignore_eos=True, stop=stop)
    assert cut.text == free.text[: free.text.find(stop)] == hf_cut.text
    assert cut.completion_ids == hf_cut.completion_ids and cut.finish_reason == "stop"


def test_a_prompt_the_engine_fails_raises_naming_it(handles):
    engine_handle, _ = handles
    with pytest.raises(
        GenerationError, match=r"prompt 1: InvalidRequestError: prompt: token ids must be in \[0, 128\)"
    ):
        engine_handle.generate(["1+1=", [1, 300]], max_tokens=2)
    assert engine_handle.generate(["1+1="], temperature=0, max_tokens=2)[0].completion_ids  # still serving


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=0,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    write_char_tokenizer(tmp_path)  # 128 ids
    with pytest.raises(VocabularyMismatchError, match="128 ids but the engine's model has 64 embedding rows"):
        EngineHandle(engine_of(tmp_path))
