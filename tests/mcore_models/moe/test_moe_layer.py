"""MoELayer on one process: against a token-by-token plain-PyTorch MoE, sequential vs grouped
experts, capacity padding and alignment, a custom router, and the aux loss in the backward pass."""

import pytest
import torch
from mcore_models.transformer.moe import (
    GroupedExperts,
    MoELayer,
    MoESubmodules,
    RouterBuilder,
    RouterOutput,
    SequentialExperts,
    aux_loss_backward_scale,
)
from mcore_testing.moe_reference import expert_weights, moe_config, reference_moe


def _layer(config, experts=SequentialExperts, router=None) -> MoELayer:
    submodules = (
        MoESubmodules(experts=experts) if router is None else MoESubmodules(experts=experts, router=router)
    )
    return MoELayer(config, submodules)


def _copy_experts(sequential: SequentialExperts, grouped: GroupedExperts) -> None:
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            grouped.weight1[e].copy_(expert.linear_fc1.weight)
            grouped.weight2[e].copy_(expert.linear_fc2.weight)
            if expert.linear_fc1.bias is not None:
                grouped.bias1[e, 0].copy_(expert.linear_fc1.bias)
                grouped.bias2[e, 0].copy_(expert.linear_fc2.bias)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_layer_matches_token_by_token_reference(dispatcher, score_function):
    torch.manual_seed(0)
    config = moe_config(moe_token_dispatcher_type=dispatcher, moe_router_score_function=score_function)
    layer = _layer(config)
    x = torch.randn(5, 3, config.hidden_size)
    out = layer(x)
    routing = layer.router(x)
    expected = reference_moe(x.reshape(-1, 16), routing.probs, routing.indices, expert_weights(layer.experts))
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equal_sequential_experts(bias):
    torch.manual_seed(1)
    config = moe_config(num_moe_experts=8, add_bias_linear=bias, moe_router_topk=1)
    sequential, grouped = _layer(config), _layer(config, GroupedExperts)
    grouped.router.load_state_dict(sequential.router.state_dict())
    if bias:  # non-zero biases, so that the routing-probability scaling of fc2's bias is checked
        with torch.no_grad():
            for expert in sequential.experts.local_experts:
                expert.linear_fc1.bias.normal_()
                expert.linear_fc2.bias.normal_()
    _copy_experts(sequential.experts, grouped.experts)
    x = torch.randn(3, 2, config.hidden_size)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = sequential(x1), grouped(x2)
    counts = torch.bincount(sequential.router(x).indices.flatten(), minlength=8)
    assert (counts == 0).any()  # 6 tokens over 8 experts, top-1: some experts get no token
    torch.testing.assert_close(out1, out2, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out1)
    out1.backward(grad)
    out2.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    for e, expert in enumerate(sequential.experts.local_experts):
        torch.testing.assert_close(
            expert.linear_fc1.weight.grad, grouped.experts.weight1.grad[e], rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(
            expert.linear_fc2.weight.grad, grouped.experts.weight2.grad[e], rtol=1e-6, atol=1e-6
        )
        if bias:
            torch.testing.assert_close(
                expert.linear_fc2.bias.grad, grouped.experts.bias2.grad[e, 0], rtol=1e-6, atol=1e-6
            )
    torch.testing.assert_close(
        sequential.router.weight.grad, grouped.router.weight.grad, rtol=1e-6, atol=1e-6
    )


class _RowSpy(SequentialExperts):
    """Records the rows per expert each forward received."""

    def forward(self, rows, tokens_per_expert):
        self.seen = list(tokens_per_expert)
        return super().forward(rows, tokens_per_expert)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_padding_to_capacity_and_alignment_keeps_the_output(dispatcher):
    torch.manual_seed(2)
    base = {"moe_token_dispatcher_type": dispatcher, "moe_expert_capacity_factor": 1.0}
    plain = _layer(moe_config(**base), _RowSpy)
    padded = _layer(moe_config(**base, moe_pad_expert_input_to_capacity=True), _RowSpy)
    aligned = _layer(moe_config(**base, moe_router_padding_for_alignment=8), _RowSpy)
    for other in (padded, aligned):
        other.load_state_dict(plain.state_dict())
    x = torch.randn(6, 2, 16)
    out = plain(x)
    capacity = 6  # ceil(12 tokens * top-2 / 4 experts * 1.0)
    routing = plain.router(x)
    kept = torch.bincount(routing.indices[routing.keep], minlength=4).tolist()
    assert plain.experts.seen == kept and max(kept) <= capacity
    torch.testing.assert_close(padded(x), out)
    assert padded.experts.seen == [capacity] * 4
    torch.testing.assert_close(aligned(x), out)
    assert aligned.experts.seen == [-(-n // 8) * 8 for n in kept]
    # The drops are real: the output equals the reference over kept assignments only.
    expected = reference_moe(x.reshape(-1, 16), routing.probs, routing.indices, expert_weights(plain.experts))
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)


class ModuloRouter(torch.nn.Module):
    """A custom router defined only here: token t goes to experts t % E and (t + 1) % E with
    weights from a learned temperature."""

    def __init__(self, config):
        super().__init__()
        self.experts = config.num_moe_experts
        self.temperature = torch.nn.Parameter(torch.tensor([0.5]))

    def forward(self, hidden_states):
        tokens = hidden_states.shape[0] * hidden_states.shape[1]
        t = torch.arange(tokens)
        indices = torch.stack([t % self.experts, (t + 1) % self.experts], dim=1)
        first = torch.sigmoid(self.temperature).expand(tokens)
        return RouterOutput(
            torch.stack([first, 1 - first], dim=1), indices, aux_loss=self.temperature.sum() * 0.1
        )


def test_custom_router_plugs_in_without_library_changes():
    assert isinstance(ModuloRouter, RouterBuilder)
    torch.manual_seed(3)
    config = moe_config()
    layer = _layer(config, router=ModuloRouter)
    x = torch.randn(3, 2, 16)
    out = layer(x)
    t = torch.arange(6)
    p = torch.sigmoid(torch.tensor(0.5))
    probs = torch.stack([p.expand(6), 1 - p.expand(6)], 1)
    expected = reference_moe(
        x.reshape(-1, 16), probs, torch.stack([t % 4, (t + 1) % 4], 1), expert_weights(layer.experts)
    )
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    # The custom aux loss reaches the backward pass: d(0.1 * temperature) adds 0.1.
    out.sum().backward()
    with_aux = layer.router.temperature.grad.clone()
    layer.zero_grad()
    layer.router.temperature.grad = None
    reference_out = reference_moe(
        x.reshape(-1, 16),
        torch.stack(
            [
                torch.sigmoid(layer.router.temperature).expand(6),
                1 - torch.sigmoid(layer.router.temperature).expand(6),
            ],
            1,
        ),
        torch.stack([t % 4, (t + 1) % 4], 1),
        [(a.detach(), b.detach()) for a, b in expert_weights(layer.experts)],
    )
    reference_out.sum().backward()
    torch.testing.assert_close(with_aux, layer.router.temperature.grad + 0.1, rtol=1e-5, atol=1e-6)
    state = layer.router.state_dict()
    fresh = ModuloRouter(config)
    fresh.load_state_dict(state)
    assert fresh.temperature.item() == pytest.approx(0.5)


@pytest.mark.parametrize("load_balancing", ["aux_loss", "seq_aux_loss"])
def test_router_losses_reach_the_backward_pass(load_balancing):
    torch.manual_seed(4)
    config = moe_config(
        moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, moe_router_load_balancing_type=load_balancing
    )
    layer = _layer(config).train()
    x = torch.randn(4, 2, 16)
    layer(x).sum().backward()
    with_losses = layer.router.weight.grad.clone()
    # Oracle: the same forward without losses, plus the losses added to the objective by hand.
    plain = _layer(moe_config()).train()
    plain.load_state_dict(layer.state_dict())
    layer.zero_grad()
    routing = layer.router(x)  # its losses' gradient goes to layer.router, the rest to plain.router
    (plain(x).sum() + routing.aux_loss).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    expected = plain.router.weight.grad + layer.router.weight.grad
    torch.testing.assert_close(with_losses, expected, rtol=1e-5, atol=1e-7)
    assert set(layer.router.last_losses) == {"load_balancing_loss", "z_loss"}


def test_aux_loss_backward_scale_weights_the_router_losses():
    torch.manual_seed(5)
    layer = _layer(moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)).train()
    x = torch.randn(4, 2, 16)
    grads = []
    for scale in (1.0, 0.25):
        layer.zero_grad()
        with aux_loss_backward_scale(scale):
            out = layer(x)
        out.sum().backward()  # the scale was taken when the loss was attached
        grads.append(layer.router.weight.grad.clone())
    layer.zero_grad()
    layer.router(x).aux_loss.backward()
    aux_grad = layer.router.weight.grad.clone()
    torch.testing.assert_close(grads[0] - grads[1], 0.75 * aux_grad, rtol=1e-4, atol=1e-7)
