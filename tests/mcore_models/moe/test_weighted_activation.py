"""Weighted expert activations (``moe_weighted_activation``): the router probability multiplies
inside the activation, before fc2.

Oracles: hand-computed values on small tensors; the unweighted activation followed by the
multiplication; and the MoE layer with the probabilities applied to the expert outputs, which is
the same function when fc2 has no bias (outputs and gradients, router's included). With an fc2
bias the two differ, and the weighted layer matches a token-by-token formula written here.
"""

import math

import pytest
import torch
from mcore_models.transformer.activations import activation_function, weighted_activation_function
from mcore_models.transformer.moe import GroupedExperts, MoELayer, MoESubmodules, SequentialExperts
from mcore_testing.moe_reference import moe_config


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_weighted_swiglu_by_hand():
    act = weighted_activation_function(moe_config(activation="swiglu"))
    x = torch.tensor([[1.0, -2.0, 2.0, 0.5], [0.0, 3.0, 4.0, 1.0]])  # [gate | up], two rows
    probs = torch.tensor([0.5, 0.25])
    expected = [
        [1.0 * _sigmoid(1.0) * 2.0 * 0.5, -2.0 * _sigmoid(-2.0) * 0.5 * 0.5],
        [0.0, 3.0 * _sigmoid(3.0) * 1.0 * 0.25],
    ]
    torch.testing.assert_close(act(x, probs), torch.tensor(expected))


def test_weighted_squared_relu_by_hand():
    act = weighted_activation_function(moe_config(activation="squared_relu"))
    x = torch.tensor([[-1.0, 3.0], [2.0, 0.5]])
    probs = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(act(x, probs), torch.tensor([[0.0, 2.25], [2.0, 0.125]]))


def test_weighted_clamped_quick_geglu_by_hand():
    """GPT-OSS's clamped SwiGLU: gate <= 7, |up| <= 7, g * sigmoid(1.702 g) * (up + 1) * p."""
    config = moe_config(activation="quick_geglu", activation_clamp_value=7.0, glu_linear_offset=1.0)
    act = weighted_activation_function(config)
    x = torch.tensor([[9.0, -1.0, 10.0, -8.0]])  # gates 9 (clamped to 7) and -1; ups 10 (-> 7), -8 (-> -7)
    probs = torch.tensor([0.3])
    expected = [[7.0 * _sigmoid(1.702 * 7.0) * 8.0 * 0.3, -1.0 * _sigmoid(-1.702) * -6.0 * 0.3]]
    torch.testing.assert_close(act(x, probs), torch.tensor(expected))


@pytest.mark.parametrize(
    "options",
    [
        {"activation": "swiglu"},
        {"activation": "geglu"},
        {"activation": "quick_geglu", "activation_clamp_value": 7.0, "glu_linear_offset": 1.0},
        {"activation": "squared_relu"},
        {"activation": "gelu"},
    ],
    ids=lambda o: o["activation"],
)
def test_weighted_equals_activation_times_probability(options):
    config = moe_config(**options)
    x, probs = torch.randn(3, 5, 16) * 4, torch.rand(3, 5)
    expected = activation_function(config)(x) * probs.unsqueeze(-1)
    torch.testing.assert_close(weighted_activation_function(config)(x, probs), expected)


def test_probs_of_the_wrong_shape_are_refused():
    act = weighted_activation_function(moe_config())
    with pytest.raises(ValueError, match="probs must have shape"):
        act(torch.randn(4, 16), torch.rand(4, 1))


def _pair(experts, dispatcher, **options):
    """The same MoE layer with the probabilities on the output and inside the activation."""
    torch.manual_seed(0)
    common = {"num_moe_experts": 6, "moe_token_dispatcher_type": dispatcher, **options}
    plain = MoELayer(moe_config(**common), MoESubmodules(experts=experts))
    weighted = MoELayer(moe_config(**common, moe_weighted_activation=True), MoESubmodules(experts=experts))
    weighted.load_state_dict(plain.state_dict())
    return plain, weighted


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("experts", [SequentialExperts, GroupedExperts], ids=["sequential", "grouped"])
@pytest.mark.parametrize("activation", ["swiglu", "squared_relu", "quick_geglu"])
def test_without_fc2_bias_weighting_inside_equals_weighting_the_output(experts, dispatcher, activation):
    options = {"activation": activation, "moe_router_padding_for_alignment": 4}  # padding rows too
    plain, weighted = _pair(experts, dispatcher, **options)
    x = torch.randn(5, 2, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = plain(x1), weighted(x2)
    torch.testing.assert_close(out2, out1, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out1)
    out1.backward(grad)
    out2.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    params = dict(plain.named_parameters())
    for name, param in weighted.named_parameters():
        torch.testing.assert_close(param.grad, params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (
        weighted.router.weight.grad.abs().sum() > 0
    )  # the gradient reaches the router through the activation


@pytest.mark.parametrize("experts", [SequentialExperts, GroupedExperts], ids=["sequential", "grouped"])
def test_with_fc2_bias_the_bias_is_not_weighted(experts):
    plain, weighted = _pair(experts, "alltoall", add_bias_linear=True)
    with torch.no_grad():
        for name, param in weighted.experts.named_parameters():
            if "bias" in name:
                param.normal_()
    x = torch.randn(4, 1, 16)
    tokens = x.reshape(-1, 16)
    routing = weighted.router(x)
    if experts is SequentialExperts:
        layers = [(e.linear_fc1, e.linear_fc2) for e in weighted.experts.local_experts]
        fc = [(l1.weight, l1.bias, l2.weight, l2.bias) for l1, l2 in layers]
    else:
        e = weighted.experts
        fc = [(e.weight1[i], e.bias1[i, 0], e.weight2[i], e.bias2[i, 0]) for i in range(6)]
    act = activation_function(weighted.config)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            w1, b1, w2, b2 = fc[int(routing.indices[t, j])]
            expected[t] += (act(tokens[t] @ w1.T + b1) * routing.probs[t, j]) @ w2.T + b2
    with torch.no_grad():
        torch.testing.assert_close(weighted(x).reshape(-1, 16), expected, rtol=1e-5, atol=1e-5)
        weighted_out = weighted(x)
        plain.load_state_dict(weighted.state_dict())
        assert (plain(x) - weighted_out).abs().max() > 1e-3  # the output weighting scales fc2's bias
