"""TransformerConfig: derived defaults, validation errors naming fields and choices, the generated CLI."""

import pytest
from mcore_models import TransformerConfig
from mcore_parallel import ConfigError, parse_dataclasses

SHAPE = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8}


def test_derived_defaults():
    config = TransformerConfig(**SHAPE)
    assert (config.num_query_groups, config.ffn_hidden_size, config.kv_channels) == (8, 256, 8)
    assert not config.gated_linear_unit
    assert TransformerConfig(**SHAPE, activation="swiglu").gated_linear_unit


@pytest.mark.parametrize(
    ("overrides", "fields", "allowed"),
    [
        ({"softmax_type": "sparse"}, "softmax_type", "['vanilla', 'off-by-one', 'learnable']"),
        ({"normalization": "BatchNorm"}, "normalization", "['LayerNorm', 'RMSNorm']"),
        (
            {"position_embedding_type": "alibi"},
            "position_embedding_type",
            "'learned_absolute', 'rope', 'yarn'",
        ),
        ({"activation": "tanh"}, "activation", "'swiglu'"),
        ({"num_query_groups": 3}, "num_attention_heads, num_query_groups", "multiple"),
        ({"window_attn_skip_freq": [1, 0]}, "window_attn_skip_freq, window_size", "needs window_size"),
        ({"window_size": 4, "window_attn_skip_freq": [1, 0]}, "window_attn_skip_freq, num_layers", "0 or 1"),
        ({"hidden_dropout": -0.1}, "hidden_dropout", ">= 0.0"),
        (
            {"num_query_groups": 2, "tensor_model_parallel_size": 4},
            "num_query_groups, tensor_model_parallel_size",
            "divisible",
        ),
        ({"cp_comm_type": "a2a"}, "cp_comm_type", "['p2p', 'all_gather']"),
        ({"rotary_percent": 0.0}, "rotary_percent", "in (0, 1]"),
        ({"rotary_percent": 1.5}, "rotary_percent", "in (0, 1]"),
        (
            {"position_embedding_type": "rope", "kv_channels": 6, "rotary_percent": 0.5},
            "rotary_percent, kv_channels",
            "= 3 channels; it must be even",
        ),
        (
            {"expert_tensor_parallel_size": 2},
            "expert_tensor_parallel_size, num_moe_experts",
            "set num_moe_experts",
        ),
        (
            {"num_moe_experts": 4, "moe_ffn_hidden_size": 6, "expert_tensor_parallel_size": 4},
            "expert_tensor_parallel_size, moe_ffn_hidden_size",
            "divisible",
        ),
        (
            {"expert_model_parallel_size": 2},
            "expert_model_parallel_size, num_moe_experts",
            "set num_moe_experts",
        ),
    ],
)
def test_invalid_values_name_the_field_and_the_allowed_values(overrides, fields, allowed):
    with pytest.raises(ConfigError) as error:
        TransformerConfig(**SHAPE | overrides)
    assert str(error.value).startswith(fields + ":")
    assert allowed in str(error.value)


def test_window_patterns():
    every_third_full = TransformerConfig(**SHAPE, window_size=4, window_attn_skip_freq=3)
    assert every_third_full.window_attn_skip_freq == [3]
    assert [every_third_full.window_for_layer(n) for n in range(1, 5)] == [4, 4, None, 4]
    per_layer = TransformerConfig(**SHAPE, window_size=4, window_attn_skip_freq=[0, 1, 1, 0])
    assert [per_layer.is_window_attention_layer(n) for n in range(1, 5)] == [False, True, True, False]
    all_windowed = TransformerConfig(**SHAPE, window_size=4)
    assert all(all_windowed.is_window_attention_layer(n) for n in range(1, 5))


def test_cli_is_generated_from_the_fields():
    (config,) = parse_dataclasses(
        [TransformerConfig],
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "
        "--normalization RMSNorm --activation quick_geglu --glu-linear-offset 1.0 "
        "--position-embedding-type yarn --yarn-rotary-scaling-factor 4 --no-yarn-correction-range-round-to-int "
        "--window-size 8 --window-attn-skip-freq 1 0 --softmax-type learnable --qk-layernorm "
        "--recompute-granularity selective --tensor-model-parallel-size 2 --sequence-parallel".split(),
    )
    assert config.num_query_groups == 2 and config.normalization == "RMSNorm"
    assert config.activation == "quick_geglu" and config.glu_linear_offset == 1.0
    assert config.position_embedding_type == "yarn" and config.yarn_rotary_scaling_factor == 4.0
    assert config.yarn_correction_range_round_to_int is False
    assert config.window_attn_skip_freq == [1, 0] and config.softmax_type == "learnable"
    assert config.qk_layernorm and config.recompute_granularity == "selective" and config.sequence_parallel
    with pytest.raises(SystemExit):
        parse_dataclasses(
            [TransformerConfig],
            "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --softmax-type x".split(),
        )
