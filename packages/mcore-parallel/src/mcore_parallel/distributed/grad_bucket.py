"""``GradBucket``: a contiguous slice of the gradient buffer, reduced across data-parallel ranks at once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import internal_api


@internal_api
class GradBucket:
    """Parameters whose gradients sit side by side in ``grad_data`` and are reduced together.

    With ``reduce_scatter`` (distributed optimizer) this rank keeps only its ``1/dp`` shard of the
    reduced bucket, in ``main_grad_shard``; ``param_data`` then holds the parameters in the same
    layout so the updated shards can be all-gathered. Otherwise ``grad_data`` is all-reduced in place.
    The reduction is asynchronous: ``start_grad_sync`` launches it, ``finish_grad_sync`` waits.
    """

    def __init__(
        self,
        param_offsets: dict[torch.nn.Parameter, int],
        grad_data: torch.Tensor,
        param_data: torch.Tensor | None,
        dp_group: dist.ProcessGroup,
        scaling_factor: float,
        reduce_scatter: bool,
        fp32_accumulation: bool,
    ):
        self.param_offsets = param_offsets  # element offset of each parameter inside the bucket
        self.params = list(param_offsets)
        self.grad_data = grad_data
        self.param_data = param_data
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.scaling_factor = scaling_factor
        self.reduce_scatter = reduce_scatter
        self.fp32_accumulation = fp32_accumulation
        self.shard_numel = grad_data.numel() // self.dp_size
        self.shard_start = self.dp_rank * self.shard_numel
        self.main_grad_shard: torch.Tensor | None = None
        self._pending: set[torch.nn.Parameter] = set(self.params)
        self._handle: dist.Work | None = None
        self._received: torch.Tensor | None = None
        self._started = False

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Record that ``param``'s gradient is final; ``True`` once every gradient of the bucket is."""
        self._pending.discard(param)
        return not self._pending

    def start_grad_sync(self) -> None:
        """Launch the asynchronous reduction of this bucket (once per iteration)."""
        if self._started:
            return
        self._started = True
        if self.dp_size == 1:
            self.grad_data.mul_(self.scaling_factor)
            return
        if self.fp32_accumulation:
            self._received = torch.empty_like(self.grad_data)
            self._handle = dist.all_to_all_single(
                self._received, self.grad_data, group=self.dp_group, async_op=True
            )
            return
        self.grad_data.mul_(self.scaling_factor)
        if self.reduce_scatter:
            self._received = self.grad_data.new_empty(self.shard_numel)
            self._handle = dist.reduce_scatter_tensor(
                self._received, self.grad_data, group=self.dp_group, async_op=True
            )
        else:
            self._handle = dist.all_reduce(self.grad_data, group=self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch the reduction if backward did not, wait for it and publish the reduced gradients."""
        self.start_grad_sync()
        if self._handle is not None:
            self._handle.wait()
        if self.fp32_accumulation and self._received is not None:
            parts = self._received.view(self.dp_size, self.shard_numel).float()
            self.main_grad_shard = parts.sum(dim=0).mul_(self.scaling_factor)
        elif self.reduce_scatter:
            shard = self._received if self._received is not None else self.local_grad_view()
            self.main_grad_shard = shard
        if self.reduce_scatter:
            self.local_grad_view().copy_(self.main_grad_shard)
        self._handle = self._received = None
        self._started = False
        self._pending = set(self.params)

    def local_grad_view(self) -> torch.Tensor:
        """This rank's shard of the bucket's gradient buffer."""
        return self.grad_data.narrow(0, self.shard_start, self.shard_numel)

    def local_param_view(self) -> torch.Tensor:
        """This rank's shard of the bucket's parameter buffer (distributed optimizer only)."""
        if self.param_data is None:
            raise RuntimeError("this bucket has no parameter buffer; it needs use_distributed_optimizer")
        return self.param_data.narrow(0, self.shard_start, self.shard_numel)

    def all_gather_params(self) -> None:
        """Gather every rank's updated parameter shard into the full parameter buffer."""
        if self.dp_size > 1:
            dist.all_gather_into_tensor(self.param_data, self.local_param_view().clone(), group=self.dp_group)
