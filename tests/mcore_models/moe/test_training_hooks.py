"""The MoE hooks of the training loop: the expert-bias update summed over data-parallel ranks
(hand-computed), and the router losses it logs."""

import torch
import torch.distributed as dist
from mcore_models.transformer.moe import (
    MoELayer,
    MoESubmodules,
    SequentialExperts,
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
