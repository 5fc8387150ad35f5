"""The engine on a model with CPU weight packing (``mcore_parallel.set_cpu_weight_packing``, what
``mcore-serve`` turns on by default): with oneDNN's layout bfloat16 generations equal the unpacked
model's; with the float32 layout (CPUs without a bfloat16 matmul) prompt log-probabilities are the
unpacked model's within bfloat16 rounding; with either, turning it on again after weights were
written behind autograd's back packs them afresh."""

import pytest
import torch
from mcore_inference import SamplingParams
from mcore_inference.serve_cli.config import EngineProcessConfig
from mcore_parallel import cpu_weight_packing_available, set_cpu_weight_packing

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8)
SCORE = SamplingParams(temperature=0.0, num_tokens_to_generate=1, prompt_logprobs=True)
LAYOUTS = [
    "float32",
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(
            not cpu_weight_packing_available(), reason="this CPU or torch build has no oneDNN bfloat16 matmul"
        ),
    ),
]


def _generate(engine, prompts):
    return [list(r.generated_tokens) for r in engine.generate(prompts, GREEDY)]


def _packed_layers(model):
    return [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]


def _prompt_logprobs(engine, prompts):
    return torch.tensor([lp for r in engine.generate(prompts, SCORE) for lp in r.prompt_logprobs[1:]])


def test_onednn_packed_model_generates_what_the_unpacked_one_does(make_model, make_engine, prompts_factory):
    if not cpu_weight_packing_available():
        pytest.skip("this CPU or torch build has no oneDNN bfloat16 matmul")
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(5, 3, 20, seed=1)
    unpacked = _generate(make_engine(model), prompts)
    assert not _packed_layers(model)  # off unless turned on
    set_cpu_weight_packing(model, True, layout="onednn")
    packed = _generate(make_engine(model), prompts)
    layers = _packed_layers(model)
    assert layers and all(layer.packed_weight._packed is not None for layer in layers)
    assert packed == unpacked


def test_float32_layout_scores_prompts_as_the_unpacked_model(make_model, make_engine, prompts_factory):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(5, 3, 20, seed=1)
    unpacked = _prompt_logprobs(make_engine(model), prompts)
    set_cpu_weight_packing(model, True, layout="float32")
    packed = _prompt_logprobs(make_engine(model), prompts)
    layers = _packed_layers(model)
    assert layers and all(layer.packed_weight._packed.dtype == torch.float32 for layer in layers)
    # both are bfloat16 forwards: they differ only by the summation order of the products
    torch.testing.assert_close(packed, unpacked, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packing_again_takes_weights_written_behind_autograds_back(
    layout, make_model, make_engine, prompts_factory
):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(4, 3, 12, seed=2)
    set_cpu_weight_packing(model, True, layout=layout)
    engine = make_engine(model)
    before = _generate(engine, prompts)
    engine.suspend()  # a weight refit: the cached prompts' keys and values go too
    for parameter in model.parameters():
        parameter.data.mul_(-1)  # in place through .data: no version counter sees it
    fresh = make_model().to(torch.bfloat16)
    fresh.load_state_dict(model.state_dict())  # the written weights, never packed before
    set_cpu_weight_packing(model, True, layout=layout)  # fresh, empty copies
    engine.resume()
    after = _generate(engine, prompts)
    set_cpu_weight_packing(fresh, True, layout=layout)
    assert after != before
    assert after == _generate(make_engine(fresh), prompts)


def test_mcore_serve_packs_by_default():
    assert EngineProcessConfig().pack_cpu_weights is True
