"""The engine's ``pack_cpu_weights``: bfloat16 generations equal the unpacked engine's, and
``suspend``/``resume`` packs afresh from the weights as they are then."""

import pytest
import torch
from mcore_inference import SamplingParams
from mcore_parallel import cpu_weight_packing_available

pytestmark = pytest.mark.skipif(
    not cpu_weight_packing_available(), reason="this CPU or torch build has no oneDNN bfloat16 matmul"
)

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8)


def _generate(engine, prompts):
    return [list(r.generated_tokens) for r in engine.generate(prompts, GREEDY)]


def _packed_layers(model):
    return [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]


def test_packed_engine_generates_what_the_unpacked_one_does(make_model, make_engine, prompts_factory):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(5, 3, 20, seed=1)
    unpacked = _generate(make_engine(model, pack_cpu_weights=False), prompts)
    assert not _packed_layers(model)
    packed = _generate(make_engine(model), prompts)
    layers = _packed_layers(model)
    assert layers and all(layer.packed_weight._packed is not None for layer in layers)
    assert packed == unpacked


def test_resume_packs_weights_written_behind_autograds_back(make_model, make_engine, prompts_factory):
    model = make_model().to(torch.bfloat16)
    prompts = prompts_factory(4, 3, 12, seed=2)
    engine = make_engine(model)
    before = _generate(engine, prompts)
    engine.suspend()
    assert not _packed_layers(model)  # suspend frees the copies with the cache
    for parameter in model.parameters():
        parameter.data.mul_(-1)  # in place through .data: no version counter sees it
    engine.resume()
    after = _generate(engine, prompts)
    assert after != before
    assert after == _generate(make_engine(model, pack_cpu_weights=False), prompts)
