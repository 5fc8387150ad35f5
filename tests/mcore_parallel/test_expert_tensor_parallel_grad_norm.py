"""The global gradient norm with experts split over expert-tensor-parallel ranks: each element of
the whole model counted once (hand-computed on 4 ranks: TP = 1, ETP = 2, EP = 2).

Every rank holds a dense parameter (replicated, gradient ``1`` everywhere), an expert slice
(``expert_tensor_parallel_dim`` set: each rank's slice differs) and an expert tensor replicated over
its expert-TP pair (counted once per pair)."""

import math

import torch
import torch.distributed as dist
from mcore_parallel import clip_grad_norm, initialize_model_parallel


def _norm_body():
    rank = dist.get_rank()
    groups = initialize_model_parallel(expert_tensor_parallel_size=2, expert_model_parallel_size=2)
    dense = torch.nn.Parameter(torch.zeros(3))
    dense.grad = torch.ones(3)
    expert_slice = torch.nn.Parameter(torch.zeros(2))
    expert_slice.grad = torch.full((2,), float(rank + 1))
    expert_slice.expert_parallel, expert_slice.expert_tensor_parallel_dim = True, 0
    replicated = torch.nn.Parameter(torch.zeros(1))
    ep_rank = dist.get_rank(groups.ep)
    replicated.grad = torch.full((1,), 10.0 * (ep_rank + 1))  # the same on both ranks of a pair
    replicated.expert_parallel = True
    return clip_grad_norm([dense, expert_slice, replicated], 0.0, groups), dist.get_rank(groups.expert_tp)


def test_expert_slices_count_once_and_replicas_once_per_pair(run_distributed):
    results = run_distributed(_norm_body, 4)
    # dense: 3 ones; slices: 2 x (1 + 4 + 9 + 16); replicated: one per EP rank, 10 and 20
    expected = math.sqrt(3 + 2 * (1 + 4 + 9 + 16) + 100 + 400)
    assert [norm for norm, _ in results] == [expected] * 4
    assert sorted(etp_rank for _, etp_rank in results) == [0, 0, 1, 1]
