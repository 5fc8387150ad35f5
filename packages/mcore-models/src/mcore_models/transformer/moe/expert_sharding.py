"""Expert tensor parallelism inside the experts: each expert's FC1 split by output rows (column
parallel) and FC2 by input columns (row parallel) over the expert-tensor-parallel group.

A sharded parameter carries ``expert_tensor_parallel_dim`` (the dimension split over the group)
and, for gated FC1 rows ``[gate; up]``, ``gated_halves = True``: rank ``r`` then holds
``[gate slice r; up slice r]``. FC2's bias is not split: it joins the output of group rank 0 only
(the partial outputs are summed over the group) and its gradient is summed over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import copy_to_tensor_model_parallel_region

EXPERT_TP_DIM = "expert_tensor_parallel_dim"


def expert_tp_size(group: dist.ProcessGroup | None) -> int:
    """Size of the expert-tensor-parallel group (1 without one)."""
    return dist.get_world_size(group) if group is not None else 1


def expert_tp_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's place in the expert-tensor-parallel group (0 without one)."""
    return dist.get_rank(group) if group is not None else 0


def sharded_width(ffn_hidden_size: int, group: dist.ProcessGroup | None) -> int:
    """One rank's share of an expert's hidden width."""
    size = expert_tp_size(group)
    if ffn_hidden_size % size:
        raise ValueError(
            f"moe_ffn_hidden_size ({ffn_hidden_size}) must be divisible by the expert-tensor-parallel size ({size})"
        )
    return ffn_hidden_size // size


def mark_sharded(param: torch.Tensor, dim: int, gated: bool = False) -> None:
    """Tag ``param`` as split along ``dim`` over the expert-tensor-parallel group."""
    setattr(param, EXPERT_TP_DIM, dim)
    if gated:
        param.gated_halves = True


def shard(full: torch.Tensor, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (of each half for gated rows)."""
    halves = full.chunk(2, dim) if gated else (full,)
    return torch.cat([half.chunk(size, dim)[rank] for half in halves], dim).clone()


def unshard(pieces: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    """The full tensor from every rank's slice, rank 0's first (inverse of ``shard``)."""
    if not gated:
        return torch.cat(pieces, dim)
    halves = [piece.chunk(2, dim) for piece in pieces]
    return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)


def gather_slices(tensor: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor of ``tensor`` (this rank's slice of the sharded ``param``, or a state of
    it), gathered over ``group`` (collective)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return unshard(pieces, getattr(param, EXPERT_TP_DIM), getattr(param, "gated_halves", False))


def shard_expert_state(full: dict, experts: torch.nn.Module, group: dist.ProcessGroup | None) -> dict:
    """``full`` (an unsharded state dict of ``experts``' shape) cut to this rank's slices, as the
    parameters of ``experts`` are tagged."""
    size, rank = expert_tp_size(group), expert_tp_rank(group)
    params = dict(experts.named_parameters())
    result = {}
    for name, value in full.items():
        dim = getattr(params.get(name), EXPERT_TP_DIM, None)
        if dim is None or size == 1:
            result[name] = value
        else:
            result[name] = shard(value, dim, rank, size, getattr(params[name], "gated_halves", False))
    return result


def output_bias(bias: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """FC2's bias as this rank adds it to its partial output: whole on group rank 0, zero elsewhere,
    its gradient summed over the group (so every rank's copy gets the full gradient)."""
    if expert_tp_size(group) == 1:
        return bias
    bias = copy_to_tensor_model_parallel_region(bias, group)
    return bias if expert_tp_rank(group) == 0 else bias * 0.0
