"""``DynamicInferenceEngine.update_weights``: new weights written in place between steps, the prefix
cache dropped (a prompt cached before is computed again, with the new weights), the version
counted; refused while a request is unfinished. Oracle: the full-recompute greedy decode of the
model with the new weights."""

import pytest
import torch
from mcore_inference import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=4)
PROMPT = [5, 17, 42, 8, 99, 3, 61, 20, 7]  # two full blocks of 4


def _load_from(source):
    """A ``load`` copying ``source``'s parameters into the engine's model in place."""

    def load(model):
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(source.get_parameter(name))

    return load


def test_new_weights_are_used_and_the_cached_prefix_is_computed_again(make_model, make_engine, oracle):
    model, other = make_model(seed=0), make_model(seed=1)
    engine = make_engine(model)
    assert engine.weight_version == 0
    old = engine.generate([PROMPT], GREEDY)[0].generated_tokens
    engine.generate([PROMPT], GREEDY)
    hits = engine.cache_stats()["prefix_cache_hit_tokens"]
    assert hits == 8 and engine.context.allocator.num_cached_blocks > 0
    assert engine.update_weights(_load_from(other)) == 1 == engine.weight_version
    assert engine.context.allocator.num_cached_blocks == 0
    new = engine.generate([PROMPT], GREEDY)[0].generated_tokens
    assert engine.cache_stats()["prefix_cache_hit_tokens"] == hits  # nothing stale was read
    assert new == oracle(other, PROMPT, 4) != old


def test_refused_while_a_request_is_unfinished(make_model, make_engine):
    engine = make_engine(make_model())
    calls = []
    request = engine.add_request(PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.update_weights(calls.append)
    engine.suspend()  # suspended requests are still unfinished
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.update_weights(calls.append)
    assert calls == [] and engine.weight_version == 0
    engine.resume()
    while not request.finished:
        engine.step()
    engine.suspend()  # allowed while suspended, once no request is left
    assert engine.update_weights(calls.append) == 1 and calls == [engine.model]


def test_a_load_that_raises_drops_the_cache_and_keeps_the_version(make_model, make_engine):
    engine = make_engine(make_model())
    engine.generate([PROMPT], GREEDY)
    assert engine.context.allocator.num_cached_blocks > 0

    def load(model):
        raise OSError("trainer gone")

    with pytest.raises(OSError, match="trainer gone"):
        engine.update_weights(load)
    assert engine.context.allocator.num_cached_blocks == 0 and engine.weight_version == 0
