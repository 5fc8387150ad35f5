"""MoE fields of TransformerConfig: derived defaults, and each bad value or combination rejected
with an error naming the fields."""

import pytest
from mcore_models import TransformerConfig
from mcore_parallel import ConfigError, parse_dataclasses

SHAPE = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "num_moe_experts": 8}


def test_moe_defaults_and_cli():
    config = TransformerConfig(**SHAPE, ffn_hidden_size=24)
    assert config.moe_ffn_hidden_size == 24
    (parsed,) = parse_dataclasses(
        [TransformerConfig],
        [
            *("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"),
            *("--num-moe-experts", "4", "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid"),
            "--moe-grouped-gemm",
            *("--moe-router-linear-bias", "--moe-weighted-activation"),
        ],
    )
    assert parsed.moe_router_linear_bias and parsed.moe_weighted_activation
    assert (parsed.num_moe_experts, parsed.moe_router_topk, parsed.moe_router_score_function) == (
        4,
        1,
        "sigmoid",
    )
    assert parsed.moe_grouped_gemm


@pytest.mark.parametrize(
    ("overrides", "fields", "says"),
    [
        ({"moe_router_topk": 9}, "moe_router_topk, num_moe_experts", "at most"),
        ({"expert_model_parallel_size": 3}, "num_moe_experts, expert_model_parallel_size", "divisible"),
        (
            {"tensor_model_parallel_size": 2, "sequence_parallel": True},
            "num_moe_experts, sequence_parallel",
            "sequence parallelism",
        ),
        (
            {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": True},
            "moe_router_pre_softmax",
            "softmax",
        ),
        ({"moe_router_num_groups": 2}, "moe_router_num_groups, moe_router_group_topk", "both"),
        ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "moe_router_num_groups", "divide"),
        (
            {"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_topk": 3},
            "moe_router_topk",
            "multiple",
        ),
        (
            {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.1},
            "moe_aux_loss_coeff",
            "needs",
        ),
        ({"moe_input_jitter_eps": 1.5}, "moe_input_jitter_eps", "(0, 1)"),
        ({"moe_expert_capacity_factor": 0.0}, "moe_expert_capacity_factor", "> 0"),
        (
            {"moe_expert_capacity_factor": 1.0, "context_parallel_size": 2},
            "moe_expert_capacity_factor, context_parallel_size",
            "context parallelism",
        ),
        ({"moe_pad_expert_input_to_capacity": True}, "moe_pad_expert_input_to_capacity", "capacity"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate", "shared expert"),
        ({"moe_token_drop_policy": "random"}, "moe_token_drop_policy", "'probs', 'position'"),
        ({"moe_router_padding_for_alignment": 0}, "moe_router_padding_for_alignment", ">= 1"),
        ({"num_moe_experts": 0}, "num_moe_experts", ">= 1"),
        ({"transformer_impl": "transformer_engine"}, "num_moe_experts, transformer_impl", "local"),
        (
            {"num_moe_experts": None, "moe_weighted_activation": True},
            "moe_weighted_activation, num_moe_experts",
            "MoE layers",
        ),
        (
            {"num_moe_experts": None, "moe_router_linear_bias": True},
            "moe_router_linear_bias, num_moe_experts",
            "MoE layers",
        ),
    ],
)
def test_bad_moe_values_name_their_fields(overrides, fields, says):
    with pytest.raises(ConfigError) as error:
        TransformerConfig(**SHAPE | overrides)
    assert fields in str(error.value).split(": ")[0]
    assert says in str(error.value)
