"""Router losses under context parallelism: two ranks each route half of every sequence, with
``context_parallel_group`` set; the mean of their losses and of their router-weight gradients (what
data x context parallel averaging makes of them) equals the loss and gradient of the whole sequences
on one router. Without the group the halves balance only themselves and the mean differs."""

import pytest
import torch
import torch.distributed as dist
from mcore_models.transformer.moe import TopKRouter
from mcore_testing.moe_reference import moe_config


def _loss_and_grad(router: TopKRouter, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    router.weight.grad = None
    loss = router(hidden).aux_loss
    loss.backward()
    return loss.detach(), router.weight.grad.clone()


def _body(load_balancing: str, with_group: bool):
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same router weights on both ranks
    config = moe_config(
        moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, moe_router_load_balancing_type=load_balancing
    )
    router = TopKRouter(config).train()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # collective
    router.context_parallel_group = dist.group.WORLD if with_group else alone
    whole = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    loss, grad = _loss_and_grad(router, whole[4 * rank : 4 * rank + 4])
    mean = torch.stack((loss, *grad.flatten()))
    dist.all_reduce(mean)
    mean /= 2
    router.context_parallel_group = alone  # this rank holds the whole sequences
    expected_loss, expected_grad = _loss_and_grad(router, whole)
    return mean[0], mean[1:].view_as(grad), expected_loss, expected_grad


@pytest.mark.parametrize("load_balancing", ["aux_loss", "seq_aux_loss"])
def test_context_parallel_ranks_share_the_whole_sequences_losses(load_balancing, run_distributed):
    for loss, grad, expected_loss, expected_grad in run_distributed(_body, 2, load_balancing, True):
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_without_the_group_the_halves_balance_only_themselves(run_distributed):
    for loss, _, expected_loss, _ in run_distributed(_body, 2, "aux_loss", False):
        assert not torch.allclose(loss, expected_loss, rtol=1e-4, atol=0)
