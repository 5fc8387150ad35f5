"""Tensor-parallel layers one at a time: initialisation, options, masking, cross entropy, errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    initialize_model_parallel,
    parallel_state,
    vocab_parallel_cross_entropy,
)


def _initialisation_is_a_slice_of_the_master_weight():
    torch.manual_seed(7)
    column = ColumnParallelLinear(6, 4, tp_group=dist.group.WORLD)
    torch.manual_seed(7)
    row = RowParallelLinear(6, 4, tp_group=dist.group.WORLD)
    torch.manual_seed(7)
    master = torch.empty(4, 6).normal_(0.0, 0.02)
    rank = dist.get_rank()
    assert torch.equal(column.weight, master.chunk(2, 0)[rank])
    assert torch.equal(row.weight, master.chunk(2, 1)[rank])
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0
    assert column.weight.partition_stride == 1
    assert row.weight.partition_dim == 1 and not getattr(row.bias, "tensor_model_parallel", False)
    torch.manual_seed(7)
    gated = ColumnParallelLinear(6, 8, tp_group=dist.group.WORLD, stride=2)
    torch.manual_seed(7)
    master = torch.empty(8, 6).normal_(0.0, 0.02)
    gate, up = master.chunk(2, 0)  # each rank: its gate rows, then its up rows
    assert torch.equal(gated.weight, torch.cat([gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]]))
    assert gated.weight.partition_stride == 2 and gated.bias.shape == (4,)


def test_initialisation_is_a_slice_of_the_master_weight(run_distributed):
    run_distributed(_initialisation_is_a_slice_of_the_master_weight, 2)


def _full_input_and_gathered_output():
    torch.manual_seed(0)
    weight1, bias1, weight2 = torch.randn(8, 6), torch.randn(8), torch.randn(5, 8)
    inputs = torch.randn(3, 6)
    rank = dist.get_rank()
    column = ColumnParallelLinear(6, 8, tp_group=dist.group.WORLD, gather_output=True)
    row = RowParallelLinear(8, 5, tp_group=dist.group.WORLD, input_is_parallel=False, bias=False)
    skip = ColumnParallelLinear(6, 8, tp_group=dist.group.WORLD, skip_bias_add=True)
    with torch.no_grad():
        for layer in (column, skip):
            layer.weight.copy_(weight1.chunk(2, 0)[rank])
            layer.bias.copy_(bias1.chunk(2, 0)[rank])
        row.weight.copy_(weight2.chunk(2, 1)[rank])
    hidden, no_bias = column(inputs)
    output, row_bias = row(hidden)
    local, bias = skip(inputs)
    expected_hidden = inputs @ weight1.T + bias1
    assert no_bias is None and row_bias is None
    assert torch.allclose(hidden, expected_hidden, atol=1e-6)
    assert torch.allclose(output, expected_hidden @ weight2.T, atol=1e-5)
    assert bias is skip.bias and torch.allclose(local + bias, expected_hidden.chunk(2, -1)[rank], atol=1e-6)


def test_gather_output_full_input_and_skip_bias_add(run_distributed):
    run_distributed(_full_input_and_gathered_output, 2)


def _embedding_masks_ids_of_other_ranks():
    embedding = VocabParallelEmbedding(8, 3, tp_group=dist.group.WORLD)
    rank = dist.get_rank()
    with torch.no_grad():
        embedding.weight.copy_(torch.arange(12.0).view(4, 3) + 100 * rank)
    ids = torch.tensor([[0, 3, 4, 7]])
    full = embedding(ids)
    table = torch.cat([torch.arange(12.0).view(4, 3) + 100 * r for r in range(2)])
    assert torch.equal(full, table[ids])
    return (embedding.vocab_start_index, embedding.vocab_end_index)


def test_embedding_rows_and_masking(run_distributed):
    assert run_distributed(_embedding_masks_ids_of_other_ranks, 2) == [(0, 4), (4, 8)]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_vocab_parallel_cross_entropy_matches_torch(run_distributed, label_smoothing):
    def body():
        torch.manual_seed(3)
        logits = torch.randn(5, 3, 12) * 4
        target = torch.randint(0, 12, (5, 3))
        upstream = torch.rand(5, 3)
        reference_logits = logits.clone().requires_grad_()
        expected = F.cross_entropy(
            reference_logits.flatten(0, 1),
            target.flatten(),
            reduction="none",
            label_smoothing=label_smoothing,
        ).view(5, 3)
        (expected * upstream).sum().backward()
        rank, world = dist.get_rank(), dist.get_world_size()
        local = logits.chunk(world, -1)[rank].clone().requires_grad_()
        losses = vocab_parallel_cross_entropy(local, target, dist.group.WORLD, label_smoothing)
        (losses * upstream).sum().backward()
        assert torch.allclose(losses, expected.detach(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(local.grad, reference_logits.grad.chunk(world, -1)[rank], rtol=1e-5, atol=1e-7)

    run_distributed(body, 2)


def _layers_default_to_the_global_group():
    initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        layer = ColumnParallelLinear(4, 4)
        return dist.get_process_group_ranks(layer.tp_group), layer.weight.shape[0]
    finally:
        parallel_state.destroy_model_parallel()


def test_layers_default_to_the_global_tensor_parallel_group(run_distributed):
    assert run_distributed(_layers_default_to_the_global_group, 4) == [
        ([0, 1], 2),
        ([0, 1], 2),
        ([2, 3], 2),
        ([2, 3], 2),
    ]


def _bad_arguments():
    with pytest.raises(
        ValueError, match=r"output_size \(5\) must be divisible by the tensor-parallel size \(2\)"
    ):
        ColumnParallelLinear(4, 5, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"input_size \(3\)"):
        RowParallelLinear(3, 4, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"vocab_size \(7\)"):
        VocabParallelEmbedding(7, 4, tp_group=dist.group.WORLD)
    with pytest.raises(
        ValueError, match=r"must be divisible by stride \(2\) x the tensor-parallel size \(2\)"
    ):
        ColumnParallelLinear(4, 6, tp_group=dist.group.WORLD, stride=2)
    with pytest.raises(ValueError, match="stride must be a positive int, got 0"):
        ColumnParallelLinear(4, 4, tp_group=dist.group.WORLD, stride=0)
    with pytest.raises(ValueError, match="gather_output and sequence_parallel"):
        ColumnParallelLinear(4, 4, tp_group=dist.group.WORLD, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(
            torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), dist.group.WORLD, 1.0
        )


def test_bad_arguments_are_named(run_distributed):
    run_distributed(_bad_arguments, 2)
