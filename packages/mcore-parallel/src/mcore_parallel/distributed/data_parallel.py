"""``DistributedDataParallel``: bucketed gradient reduction launched from backward hooks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..config.ddp import DistributedDataParallelConfig
from .grad_buffer import ParamAndGradBuffer


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients are reduced over ``dp_group`` in contiguous buckets.

    Gradients accumulate into ``param.main_grad`` (views into one buffer per parameter dtype; float32
    with ``grad_reduce_in_fp32``); ``param.grad`` is consumed by a post-accumulate-grad hook and left
    ``None``. With ``overlap_grad_reduce`` the hook launches a bucket's asynchronous reduction as soon
    as its last gradient arrives, so communication overlaps the rest of backward; ``finish_grad_sync``
    waits for all of them (and launches whatever backward did not). Inside ``no_sync()`` nothing is
    launched, for gradient accumulation over micro-batches. Call ``zero_grad_buffer()`` before each
    iteration. Parameters need identical values on every data-parallel rank.

    With ``expert_dp_group``, parameters marked ``expert_parallel = True`` (MoE experts, which differ
    between expert-parallel ranks) get buffers of their own, reduced over that group (the ranks
    holding the same experts) instead; their gradients are scaled like the others (``1 / dp`` for
    ``average``). Each bucket's ``dp_group`` says which group it reduces over.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: DistributedDataParallelConfig | None = None,
        dp_group: dist.ProcessGroup | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.module = module
        self.config = config if config is not None else DistributedDataParallelConfig()
        self.dp_group = dp_group if dp_group is not None else dist.group.WORLD
        self.expert_dp_group = expert_dp_group
        dp_size = dist.get_world_size(self.dp_group)
        # experts' gradients are summed over their (smaller) group but divided by the full DP size:
        # the tokens of every DP rank reached them through the expert-parallel exchange
        scaling = 1.0 / dp_size if self.config.grad_reduce_op == "average" else 1.0
        dense: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        experts: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in module.parameters():
            if param.requires_grad:
                split = expert_dp_group is not None and getattr(param, "expert_parallel", False)
                (experts if split else dense).setdefault(param.dtype, []).append(param)

        def buffers(by_dtype, group):
            return {
                dtype: ParamAndGradBuffer(
                    params,
                    torch.float32 if self.config.grad_reduce_in_fp32 else dtype,
                    group,
                    self.config.bucket_size,
                    scaling,
                    self.config.use_distributed_optimizer,
                    self.config.reduce_scatter_with_fp32_accumulation,
                )
                for dtype, params in by_dtype.items()
            }

        self.buffers_by_dtype: dict[torch.dtype, ParamAndGradBuffer] = buffers(dense, self.dp_group)
        self.expert_buffers_by_dtype: dict[torch.dtype, ParamAndGradBuffer] = buffers(
            experts, expert_dp_group
        )
        self._bucket_of = {
            param: bucket
            for buffer in self._all_buffers()
            for bucket in buffer.buckets
            for param in bucket.params
        }
        self._sync_enabled = True
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._accumulate) for param in self._bucket_of
        ]

    def _all_buffers(self) -> list[ParamAndGradBuffer]:
        return [*self.buffers_by_dtype.values(), *self.expert_buffers_by_dtype.values()]

    @property
    def buckets(self) -> list:
        """Every gradient bucket, over all buffers."""
        return [bucket for buffer in self._all_buffers() for bucket in buffer.buckets]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _accumulate(self, param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self._sync_enabled and self.config.overlap_grad_reduce:
            bucket = self._bucket_of[param]
            if bucket.mark_ready(param):
                bucket.start_grad_sync()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all micro-batches but the last)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet."""
        for bucket in self.buckets:
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait until every bucket is reduced: ``main_grad`` (or the local shard) then holds the result."""
        self.start_grad_sync()
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor`` (e.g. ``1 / num_micro_batches``)."""
        for buffer in self._all_buffers():
            buffer.grad_data.mul_(factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers for the next iteration."""
        for buffer in self._all_buffers():
            buffer.grad_data.zero_()
        for param in self.module.parameters():
            param.grad = None
