"""The MoE hooks of the training loop: the expert-bias update summed over data-parallel ranks
(hand-computed), the global load-balancing loss over ranks and micro-batches (against the formula
on the counts of all of them) and its reset, and the router losses it logs."""

import torch
import torch.distributed as dist
from mcore_models.transformer.moe import (
    MoELayer,
    MoESubmodules,
    SequentialExperts,
    TopKRouter,
    reset_global_loads,
    router_loss_metrics,
    update_expert_biases,
)
from mcore_testing.moe_reference import moe_config


def _bias_body():
    rank = dist.get_rank()
    config = moe_config(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)
    model = torch.nn.Sequential(
        *(MoELayer(config, MoESubmodules(experts=SequentialExperts)) for _ in range(2))
    )
    counts = [torch.tensor([4.0, 0.0, 2.0, 2.0]), torch.tensor([0.0, 1.0, 3.0, 4.0])][rank]
    for layer in model:
        layer.router.local_tokens_per_expert.copy_(counts)
    assert update_expert_biases(model, dist.group.WORLD) == 2
    # Summed counts [4, 1, 5, 6], mean 4: sign(mean - load) = [0, +1, -1, -1].
    for layer in model:
        torch.testing.assert_close(layer.router.expert_bias, torch.tensor([0.0, 0.25, -0.25, -0.25]))
        assert layer.router.local_tokens_per_expert.sum() == 0


def test_expert_bias_update_sums_counts_over_data_parallel_ranks(run_distributed):
    run_distributed(_bias_body, 2)


def test_router_loss_metrics_sum_over_layers():
    torch.manual_seed(0)
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = torch.nn.Sequential(
        *(MoELayer(config, MoESubmodules(experts=SequentialExperts)) for _ in range(2))
    )
    model.train()(torch.randn(3, 2, 16))
    metrics = router_loss_metrics(model)
    expected = sum(float(layer.router.last_losses["z_loss"]) for layer in model)
    assert set(metrics) == {"moe/load_balancing_loss", "moe/z_loss"}
    assert metrics["moe/z_loss"] == expected > 0
    assert router_loss_metrics(torch.nn.Linear(2, 2)) == {}


def _global_loss_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same router weights on both ranks
    router = TopKRouter(moe_config(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="global_aux_loss"))
    router.data_parallel_group = dist.group.WORLD
    router.train()
    batches = [[torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(10 * r + m)) for m in range(2)]
               for r in range(world)]  # fmt: skip
    losses = [router(batches[rank][m]).aux_loss for m in range(2)]
    router.eval()  # routing without losses: no collective, nothing counted
    counts = sum(torch.bincount(router(b).indices.flatten(), minlength=4) for per in batches for b in per)
    tokens = 6 * 2 * world
    # The loss of micro-batch 2: loads of micro-batches 1 and 2 of every rank, this rank's scores.
    scores = torch.softmax(torch.nn.functional.linear(batches[rank][1].reshape(-1, 16), router.weight), -1)
    expected = 0.1 * 4 * torch.sum(counts / (tokens * 2) * scores.mean(0))
    torch.testing.assert_close(losses[1], expected)
    reset_global_loads(router)
    assert router.global_load.sum() == 0


def test_global_load_balancing_loss_counts_all_ranks_and_micro_batches(run_distributed):
    run_distributed(_global_loss_body, 2)
