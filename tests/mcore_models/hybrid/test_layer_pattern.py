"""``HybridLayerPattern``: layer types and per-type maps of a pattern, pipeline stages from ``|``
or an even split, and a ``ConfigError`` naming the field for every bad pattern."""

import pytest
from mcore_models.models.hybrid import HybridLayerPattern
from mcore_parallel import ConfigError


def test_layer_types_and_map_follow_the_symbols():
    pattern = HybridLayerPattern.parse("M*E-E*-")
    assert pattern.num_layers == 7 and pattern.stages is None
    assert pattern.layer_types() == ["mamba", "attention", "moe", "mlp", "moe", "attention", "mlp"]
    assert pattern.layer_map() == {"mamba": [0], "attention": [1, 5], "mlp": [3, 6], "moe": [2, 4]}


def test_a_type_the_pattern_lacks_maps_to_no_layers():
    assert HybridLayerPattern.parse("MM").layer_map() == {
        "mamba": [0, 1],
        "attention": [],
        "mlp": [],
        "moe": [],
    }


def test_separators_place_the_pipeline_stages():
    pattern = HybridLayerPattern.parse("MM*-|M*|E")
    assert pattern.symbols == "MM*-M*E" and pattern.stages == ("MM*-", "M*", "E")
    assert pattern.stage_layers(3) == [range(0, 4), range(4, 6), range(6, 7)]
    assert pattern.layer_map()["moe"] == [6]  # global indices across stages


def test_without_separators_the_stages_are_equal_shares():
    pattern = HybridLayerPattern.parse("M*M*M*")
    assert pattern.stage_layers(1) == [range(0, 6)]
    assert pattern.stage_layers(3) == [range(0, 2), range(2, 4), range(4, 6)]


@pytest.mark.parametrize(
    ("pattern", "match"),
    [
        ("", "hybrid_layer_pattern: is empty"),
        ("M*X-", r"unknown symbol 'X' at position 2 of 'M\*X-'"),
        ("M* -", "unknown symbol ' ' at position 2"),
        ("|M*", "empty pipeline stage"),
        ("M*|", "empty pipeline stage"),
        ("M||*", "empty pipeline stage"),
        (None, "must be a string, got NoneType"),
    ],
)
def test_bad_patterns_are_refused(pattern, match):
    with pytest.raises(ConfigError, match=match) as error:
        HybridLayerPattern.parse(pattern)
    assert error.value.fields == ("hybrid_layer_pattern",)


@pytest.mark.parametrize(
    ("pattern", "pipeline_size", "match"),
    [
        ("M*|M*", 3, "the pattern has 2 pipeline stages .* but the pipeline size is 3"),
        ("M*M*M", 2, "5 layers do not split evenly over 2 pipeline stages"),
    ],
)
def test_stages_that_do_not_fit_the_pipeline_are_refused(pattern, pipeline_size, match):
    with pytest.raises(ConfigError, match=match) as error:
        HybridLayerPattern.parse(pattern).stage_layers(pipeline_size)
    assert error.value.fields == ("hybrid_layer_pattern", "pipeline_model_parallel_size")


@pytest.mark.parametrize("pipeline_size", [0, -1, True, 1.5])
def test_the_pipeline_size_must_be_a_positive_int(pipeline_size):
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size: must be a positive int"):
        HybridLayerPattern.parse("M*").stage_layers(pipeline_size)
