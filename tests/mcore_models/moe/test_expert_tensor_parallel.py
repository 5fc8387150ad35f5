"""Expert tensor parallelism on 4 forked gloo ranks: each expert's FC1 split by rows and FC2 by
columns over the expert-TP group gives the outputs and gradients of one process.

Oracle: the same layer with all experts whole on one process. Ranks of one tensor-parallel group
bring the same tokens (their ``x`` is seeded by the dense data-parallel rank); every rank's output
and router gradient must equal the one-process ones on its tokens, and its expert slices'
gradients, summed over the expert-data-parallel group, the slices of the one-process gradients of
the loss summed over the distinct token sets.
"""

import pytest
import torch
import torch.distributed as dist
from mcore_models.transformer.moe import GroupedExperts, MoELayer, MoESubmodules, SequentialExperts
from mcore_models.transformer.moe.expert_sharding import EXPERT_TP_DIM, shard
from mcore_testing.moe_reference import moe_config


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(100 + seed)
    return torch.randn(6, 2, 16, generator=generator), torch.randn(6, 2, 16, generator=generator)


def _reference_slice(reference: MoELayer, layer: MoELayer, name: str, param, grad: bool) -> torch.Tensor:
    """The one-process tensor (or its gradient) that ``layer``'s expert parameter ``name`` holds a slice of."""
    first, local = layer.local_expert_offset, layer.num_local_experts
    everything = dict(reference.experts.named_parameters())
    if name.startswith("local_experts."):
        _, index, rest = name.split(".", 2)
        full = everything[f"local_experts.{int(index) + first}.{rest}"]
        full = full.grad if grad else full.detach()
    else:
        full = (everything[name].grad if grad else everything[name].detach())[first : first + local]
    dim = getattr(param, EXPERT_TP_DIM, None)
    if dim is None:
        return full
    group = layer.expert_tp_group
    return shard(
        full, dim, dist.get_rank(group), dist.get_world_size(group), getattr(param, "gated_halves", False)
    )


def _etp_body(tp, etp, ep, dispatcher, grouped, extra, via_all_gather=False):
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    destroy_model_parallel()
    groups = initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    options = {"num_moe_experts": 8, "moe_token_dispatcher_type": dispatcher, "moe_aux_loss_coeff": 0.01}
    options |= extra
    submodules = MoESubmodules(experts=GroupedExperts if grouped else SequentialExperts)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    torch.manual_seed(0)
    reference = MoELayer(moe_config(**options), submodules, ep_group=alone).train()
    parallel = {"tensor_model_parallel_size": tp, "expert_model_parallel_size": ep}
    torch.manual_seed(0)
    config = moe_config(**options, **parallel, expert_tensor_parallel_size=etp)
    layer = MoELayer(config, submodules, exchange_via_all_gather=via_all_gather).train()
    assert dist.get_world_size(layer.expert_tp_group) == etp if etp > 1 else layer.expert_tp_group is None
    for name, param in layer.experts.named_parameters():  # initialized as the one-process slices
        torch.testing.assert_close(param.detach(), _reference_slice(reference, layer, name, param, False))

    x, grad = _inputs(rank // tp)
    out = layer(x)
    out.backward(grad)
    expected = reference(x)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, reference.router.weight.grad, rtol=1e-5, atol=1e-6)
    reference.zero_grad()
    for other in range(world // tp):
        x_other, grad_other = _inputs(other)
        reference(x_other).backward(grad_other)
    for name, param in layer.experts.named_parameters():
        summed = param.grad.clone()
        dist.all_reduce(summed, group=groups.expert_dp)
        want = _reference_slice(reference, layer, name, param, True)
        torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tp", "etp", "ep", "dispatcher", "grouped", "extra"),
    [
        (1, 2, 1, "alltoall", False, {}),
        (1, 2, 1, "allgather", True, {"add_bias_linear": True}),
        (1, 2, 2, "alltoall", True, {"add_bias_linear": True}),
        (1, 2, 2, "allgather", False, {}),
        (2, 2, 1, "alltoall", True, {"moe_weighted_activation": True, "moe_router_padding_for_alignment": 4}),
        (2, 1, 2, "alltoall", False, {"add_bias_linear": True}),
        (2, 2, 1, "allgather", False, {"activation": "gelu", "add_bias_linear": True}),
        (1, 4, 1, "alltoall", False, {"moe_weighted_activation": True}),
    ],
)
def test_expert_tensor_parallel_matches_one_process(tp, etp, ep, dispatcher, grouped, extra, run_distributed):
    run_distributed(_etp_body, 4, tp, etp, ep, dispatcher, grouped, extra, timeout=90)


# Capacity 3 of 12 local tokens x top-2 over 8 experts, drops by probability, padded inputs.
CAPACITY = {
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
    "moe_router_padding_for_alignment": 4,
}


@pytest.mark.parametrize(
    ("dispatcher", "via_all_gather", "grouped"),
    [("alltoall", True, False), ("alltoall", False, True), ("allgather", False, True)],
)
def test_expert_tensor_parallel_with_capacity_and_the_all_gather_exchange(
    dispatcher, via_all_gather, grouped, run_distributed
):
    """ETP = 2 x EP = 2 with dropped and padded rows; the uneven exchanges through padded all-gathers."""
    run_distributed(_etp_body, 4, 1, 2, 2, dispatcher, grouped, CAPACITY, via_all_gather, timeout=90)


def _refusal_body():
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    destroy_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    submodules = MoESubmodules(experts=SequentialExperts)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(1\) differs .* group \(2\)"):
        MoELayer(moe_config(expert_tensor_parallel_size=1), submodules)
    layer = MoELayer(moe_config(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), submodules)
    with pytest.raises(ValueError, match=r"its 3 tokens .* multiple of the tensor-parallel size \(2\)"):
        layer(torch.randn(3, 1, 16))


def test_layouts_that_cannot_work_are_refused(run_distributed):
    run_distributed(_refusal_body, 2, timeout=60)
