"""``ParamAndGradBuffer``: one contiguous gradient buffer (and parameter buffer) split into buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import internal_api

from .grad_bucket import GradBucket


@internal_api
class ParamAndGradBuffer:
    """The gradients of ``params`` (one dtype) laid out contiguously, in reverse order, in buckets.

    Each parameter gets ``main_grad``, a view into the buffer. Parameters are laid out last to first
    (the order backward produces their gradients) and a bucket closes once it holds at least
    ``bucket_size`` elements; with ``reduce_scatter`` every bucket is padded to a multiple of the
    data-parallel size and the parameters themselves are moved into a matching parameter buffer.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        dp_group: dist.ProcessGroup,
        bucket_size: int | None,
        scaling_factor: float,
        reduce_scatter: bool,
        fp32_accumulation: bool,
    ):
        dp_size = dist.get_world_size(dp_group)
        align = dp_size if reduce_scatter else 1
        groups: list[tuple[list[torch.nn.Parameter], int, int]] = []  # params, start, padded numel
        current: list[torch.nn.Parameter] = []
        start = numel = 0
        for param in reversed(params):
            current.append(param)
            numel += param.numel()
            if bucket_size is not None and numel >= bucket_size:
                padded = -(-numel // align) * align
                groups.append((current, start, padded))
                start, current, numel = start + padded, [], 0
        if current:
            groups.append((current, start, -(-numel // align) * align))
        total = sum(padded for _, _, padded in groups)
        device = params[0].device
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device) if reduce_scatter else None
        self.buckets: list[GradBucket] = []
        for bucket_params, bucket_start, padded in groups:
            offset, offsets = bucket_start, {}
            for param in bucket_params:
                offsets[param] = offset - bucket_start
                param.main_grad = self.grad_data.narrow(0, offset, param.numel()).view(param.shape)
                if self.param_data is not None:
                    view = self.param_data.narrow(0, offset, param.numel()).view(param.shape)
                    view.copy_(param.data)
                    param.data = view
                offset += param.numel()
            self.buckets.append(
                GradBucket(
                    offsets,
                    self.grad_data.narrow(0, bucket_start, padded),
                    None if self.param_data is None else self.param_data.narrow(0, bucket_start, padded),
                    dp_group,
                    scaling_factor,
                    reduce_scatter,
                    fp32_accumulation,
                )
            )
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
