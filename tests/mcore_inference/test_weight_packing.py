"""The engine on a model with CPU weight packing (``mcore_parallel.set_cpu_weight_packing``, what
``mcore-serve`` turns on by default): bfloat16 generations equal the unpacked model's, and turning
it on again after weights were written behind autograd's back packs them afresh."""

import pytest
import torch
from mcore_inference import SamplingParams
from mcore_inference.serve_cli.config import EngineProcessConfig
from mcore_parallel import cpu_weight_packing_available, set_cpu_weight_packing

pytestmark = pytest.mark.skipif(
    not cpu_weight_packing_available(), reason="this CPU or torch build has no oneDNN bfloat16 matmul"
)

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8)


def _generate(engine, prompts):
    return [list(r.generated_tokens) for r in engine.generate(prompts, GREEDY)]


def _packed_layers(model):
    return [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]


def test_packed_model_generates_what_the_unpacked_one_does(make_model, make_engine, prompts_factory):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(5, 3, 20, seed=1)
    unpacked = _generate(make_engine(model), prompts)
    assert not _packed_layers(model)  # off unless turned on
    set_cpu_weight_packing(model, True)
    packed = _generate(make_engine(model), prompts)
    layers = _packed_layers(model)
    assert layers and all(layer.packed_weight._packed is not None for layer in layers)
    assert packed == unpacked


def test_packing_again_takes_weights_written_behind_autograds_back(make_model, make_engine, prompts_factory):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(4, 3, 12, seed=2)
    set_cpu_weight_packing(model, True)
    engine = make_engine(model)
    before = _generate(engine, prompts)
    engine.suspend()  # a weight refit: the cached prompts' keys and values go too
    for parameter in model.parameters():
        parameter.data.mul_(-1)  # in place through .data: no version counter sees it
    set_cpu_weight_packing(model, True)  # fresh, empty copies
    engine.resume()
    after = _generate(engine, prompts)
    set_cpu_weight_packing(model, False)
    assert after != before
    assert after == _generate(make_engine(model), prompts)


def test_mcore_serve_packs_by_default():
    assert EngineProcessConfig().pack_cpu_weights is True
