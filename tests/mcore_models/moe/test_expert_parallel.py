"""Expert parallelism on forked gloo ranks: EP = 2 and 4 give the outputs and gradients of EP = 1.

Oracle: the same layer with all experts on one process, run on every rank's tokens. Each rank's
output must equal the one-process output on its tokens; its router gradient the one-process
gradient of its own tokens' loss; its experts' gradients the one-process gradients of the summed
loss over all ranks (expert parallelism moves tokens, not the math).
"""

import pytest
import torch
import torch.distributed as dist
from mcore_models import MLPSubmodules, ModuleSpec
from mcore_models.transformer.moe import (
    GroupedExperts,
    MoELayer,
    MoESubmodules,
    SequentialExperts,
    SharedExpertMLP,
)
from mcore_models.transformer.moe.row_exchange import exchange_rows
from mcore_parallel import ColumnParallelLinear, RowParallelLinear
from mcore_testing.moe_reference import expert_parallel_state, moe_config


def _inputs(rank: int, skewed: bool):
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(5, 2, 16, generator=generator)
    if skewed:  # all-positive inputs: with the skewed router below every token picks experts 0 and 1
        x = x.abs() + 1.0
    return x, torch.randn(5, 2, 16, generator=generator)


# Capacity 3 of 10 local tokens x top-2 over 8 experts, drops by probability, padded inputs.
CAPACITY = {
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
    "moe_router_padding_for_alignment": 4,
}


def _ep_body(dispatcher, via_all_gather, grouped, skewed, extra=None):
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    destroy_model_parallel()
    groups = initialize_model_parallel(expert_model_parallel_size=world)
    experts = GroupedExperts if grouped else SequentialExperts
    options = {
        "num_moe_experts": 8,
        "moe_token_dispatcher_type": dispatcher,
        "moe_aux_loss_coeff": 0.01,
        "moe_shared_expert_intermediate_size": 8,
        "moe_shared_expert_gate": True,
        **(extra or {}),
    }
    torch.manual_seed(0)
    submodules = MoESubmodules(experts=experts, shared_experts=_shared_spec())
    reference = MoELayer(moe_config(**options), submodules, tp_group=groups.tp, ep_group=groups.tp).train()
    if skewed:
        with torch.no_grad():
            reference.router.weight[:2] = 0.5
            reference.router.weight[2:] = -0.5
    layer = MoELayer(
        moe_config(**options, expert_model_parallel_size=world),
        submodules,
        tp_group=groups.tp,
        exchange_via_all_gather=via_all_gather,
    ).train()
    assert dist.get_world_size(layer.ep_group) == world
    local = layer.num_local_experts
    first = rank * local
    state = expert_parallel_state(reference.state_dict(), first, local)
    layer.load_state_dict(state)

    seen = []
    run_experts = layer.experts.forward
    layer.experts.forward = lambda rows, counts, *probs: (
        seen.append(sum(counts)) or run_experts(rows, counts, *probs)
    )
    x, grad = _inputs(rank, skewed)
    out = layer(x)
    out.backward(grad)

    expected = reference(x)
    expected.backward(grad)
    router_grad = reference.router.weight.grad.clone()
    shared_grad = reference.shared_experts.gate_weight.grad.clone()
    reference.zero_grad()
    for other in range(world):
        x_other, grad_other = _inputs(other, skewed)
        reference(x_other).backward(grad_other)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, router_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.shared_experts.gate_weight.grad, shared_grad, rtol=1e-5, atol=1e-6)
    reference_experts = dict(reference.experts.named_parameters())
    for name, param in layer.experts.named_parameters():
        if grouped:
            want = reference_experts[name].grad[first : first + local]
        else:
            index, rest = name.split(".", 2)[1], name.split(".", 2)[2]
            want = reference_experts[f"local_experts.{int(index) + first}.{rest}"].grad
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-6)
    return seen[0]


def _shared_spec():
    return ModuleSpec(
        module=SharedExpertMLP, submodules=MLPSubmodules(ColumnParallelLinear, RowParallelLinear)
    )


@pytest.mark.parametrize(
    ("world", "dispatcher", "via_all_gather", "grouped", "skewed"),
    [
        (2, "alltoall", False, False, False),
        (2, "alltoall", True, True, False),
        (2, "allgather", False, True, False),
        (4, "alltoall", False, True, False),
        (4, "alltoall", True, False, True),
        (4, "allgather", False, False, True),
    ],
)
def test_expert_parallel_matches_one_process(
    world, dispatcher, via_all_gather, grouped, skewed, run_distributed
):
    rows = run_distributed(_ep_body, world, dispatcher, via_all_gather, grouped, skewed, timeout=60)
    if skewed:  # experts 0 and 1 live on rank 0: every other rank receives zero rows
        assert rows[0] > 0 and rows[1:] == [0] * (world - 1)


def _exchange_body():
    rank = dist.get_rank()
    send = [[1, 0, 2], [0, 0, 0], [3, 1, 0]]  # rank 1 sends nothing; ranks 1 and 2 get uneven rows
    x = (torch.arange(sum(send[rank]) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank).requires_grad_()
    results = []
    for via_all_gather in (False, True):
        out = exchange_rows(x, dist.group.WORLD, send, via_all_gather=via_all_gather)
        (grad,) = torch.autograd.grad(out, x, torch.arange(out.numel(), dtype=torch.float32).view_as(out))
        results.append((out.detach(), grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    return results[0][0].tolist()


def test_uneven_row_exchange_fallback_equals_all_to_all(run_distributed):
    received = run_distributed(_exchange_body, 3)
    assert received[0] == [[0.0, 1.0], [200.0, 201.0], [202.0, 203.0], [204.0, 205.0]]
    assert received[1] == [[206.0, 207.0]]
    assert received[2] == [[2.0, 3.0], [4.0, 5.0]]


def _gpt_body():
    from mcore_models import GPTModel
    from mcore_models.transformer.specs import get_gpt_layer_local_spec
    from mcore_parallel import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]
    options = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_grouped_gemm": True, "num_layers": 2}
    options |= {"position_embedding_type": "rope"}
    torch.manual_seed(0)
    reference = GPTModel(moe_config(**options), 64, pg_collection=ProcessGroupCollection(tp=singles[rank]))
    # The model parallel state is not initialized: the EP group can only come from pg_collection.
    groups = ProcessGroupCollection(tp=singles[rank], ep=dist.group.WORLD)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    model = GPTModel(moe_config(**options, expert_model_parallel_size=world), 64, spec, pg_collection=groups)
    assert model.decoder.layers[0].mlp.ep_group is dist.group.WORLD
    assert spec.submodules.mlp.params == {}  # the caller's spec is left as it was
    model.load_state_dict(expert_parallel_state(reference.state_dict(), rank * 4 // world, 4 // world))
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).sum().backward()
    reference(ids, labels=ids).sum().backward()
    torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    name = "decoder.layers.1.mlp.router.weight"
    got, want = dict(model.named_parameters())[name].grad, dict(reference.named_parameters())[name].grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gpt_model_takes_the_expert_group_from_pg_collection(run_distributed):
    run_distributed(_gpt_body, 2, timeout=60)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_with_capacity_drops_and_padding(dispatcher, run_distributed):
    rows = run_distributed(_ep_body, 2, dispatcher, False, True, False, CAPACITY, timeout=60)
    # Every expert's input is padded to 2 ranks x capacity 3 = 6 rows, then to a multiple of 4: 8.
    assert rows == [4 * 8, 4 * 8]


@pytest.mark.parametrize(
    ("dispatcher", "via_all_gather"), [("alltoall", False), ("alltoall", True), ("allgather", False)]
)
def test_expert_parallel_with_weighted_activation(dispatcher, via_all_gather, run_distributed):
    """The routing probabilities travel with the rows to the experts' ranks (with padding rows)."""
    extra = {"moe_weighted_activation": True, "moe_router_padding_for_alignment": 4}
    run_distributed(_ep_body, 2, dispatcher, via_all_gather, False, False, extra, timeout=60)
