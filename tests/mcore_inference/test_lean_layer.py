"""mcore-models' lean inference forward of plain layers (``transformer/lean_inference.py``): the
engine takes it on a plain Llama-like model, and its prompt and generated log-probabilities are
bit for bit those of the generic layer forward (float32, and bfloat16 with packed weights), its
greedy tokens those of the full-recompute oracle; layers it does not compute exactly, calls that
autograd records and a forced reference backend take the generic forward."""

import pytest
import torch
from mcore_inference import SamplingParams
from mcore_kernels import native_rows_available, use_backend
from mcore_models.transformer import layer as layer_module
from mcore_models.transformer.lean_inference import lean_inference_applies, lean_inference_supported
from mcore_parallel import set_cpu_weight_packing

pytestmark = pytest.mark.skipif(
    not native_rows_available(), reason="the native CPU kernels do not build here"
)

PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=9, logprobs=True, prompt_logprobs=True)


@pytest.fixture
def lean_calls(monkeypatch):
    """How many layer calls took the lean forward (a spy around it)."""
    calls = []
    forward = layer_module.lean_inference_forward

    def spy(*args):
        calls.append(1)
        return forward(*args)

    monkeypatch.setattr(layer_module, "lean_inference_forward", spy)
    return calls


def _run(engine, prompts):
    done = engine.generate(prompts, PARAMS)
    return [(list(r.generated_tokens), list(r.generated_logprobs), list(r.prompt_logprobs)) for r in done]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_the_generic_one_bit_for_bit(
    dtype, make_model, make_engine, prompts_factory, lean_calls, monkeypatch
):
    model = make_model("plain-llama").to(dtype)
    if dtype == torch.bfloat16:
        set_cpu_weight_packing(model, True)
    prompts = prompts_factory(6, 2, 19, seed=3)
    lean = _run(make_engine(model, max_tokens=16), prompts)  # 16 tokens a step: prompts span steps
    assert lean_calls, "the plain model's layers did not take the lean forward"
    monkeypatch.setattr(layer_module, "lean_inference_supported", lambda layer: False)
    lean_calls.clear()
    generic = _run(make_engine(model, max_tokens=16), prompts)
    assert not lean_calls
    assert lean == generic


def test_lean_greedy_tokens_equal_the_full_recompute_oracle(
    make_model, make_engine, prompts_factory, oracle, lean_calls
):
    model = make_model("plain-llama")
    prompts = prompts_factory(3, 4, 12, seed=4)
    done = make_engine(model).generate(prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=6))
    assert lean_calls
    for prompt, request in zip(prompts, done, strict=True):
        assert list(request.generated_tokens) == oracle(model, prompt, 6)


def test_layers_it_does_not_compute_exactly_take_the_generic_forward(make_model):
    assert all(lean_inference_supported(layer) for layer in make_model("plain-llama").decoder.layers)
    assert not any(
        lean_inference_supported(layer) for layer in make_model("llama-like").decoder.layers
    )  # qk-norm
    assert not any(
        lean_inference_supported(layer) for layer in make_model("gpt-like").decoder.layers
    )  # biases


def test_recorded_calls_and_a_forced_reference_take_the_generic_forward():
    hidden = torch.randn(3, 1, 8)
    cos = sin = torch.ones(3, 1, 1, 4)
    with torch.no_grad():
        assert lean_inference_applies(hidden, (cos, sin))
        assert not lean_inference_applies(hidden, None)  # no rotary tables
        assert not lean_inference_applies(hidden, (torch.ones(3, 1, 2, 4),) * 2)  # tables per head
        assert not lean_inference_applies(hidden.double(), (cos, sin))
        with use_backend("reference"):
            assert not lean_inference_applies(hidden, (cos, sin))
    assert not lean_inference_applies(hidden, (cos, sin))  # grad mode on
