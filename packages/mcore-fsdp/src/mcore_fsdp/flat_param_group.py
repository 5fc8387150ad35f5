"""Flat per-unit parameter buffers: the parameters of one sharding unit that share a compute
dtype and a topology, laid end to end in one padded buffer.

Rank ``r`` of the shard group owns the ``r``-th equal slice of the buffer (and, with an outer
``optim`` strategy, a further slice of that across the replicate group). It keeps its owned slice
as FP32 main parameters, which the optimizer updates, and an FP32 main gradient. The gathered
buffer holds the compute parameters; module parameters are views into it, so an all-gather
writes straight into the tensors the forward uses, with no copy-out.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mcore_fsdp import collectives
from mcore_fsdp.collectives import Pending
from mcore_fsdp.strategies import ShardingStrategy
from mcore_fsdp.topology import ShardingTopology


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in its group's flat buffer.

    ``owners`` are the ``(module, attribute)`` pairs it is registered under (several for tied
    weights) and ``fqns`` their fully qualified names. ``local_start:local_stop`` is the part of
    the flattened parameter this rank owns as main parameter (possibly empty).
    """

    fqns: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size
    offset: int
    numel: int
    requires_grad: bool
    local_start: int
    local_stop: int


@dataclass(frozen=True)
class GroupConfig:
    """How a group shards, computes and communicates."""

    topology: ShardingTopology
    strategy: ShardingStrategy
    outer_optim: bool
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    fp32_accumulate_reduce_scatter: bool
    offload: bool
    grad_divisor: float
    expert: bool = False


class FlatParamGroup:
    """One flat buffer of parameters, its FP32 main shard, and its gradient reduction."""

    def __init__(self, params: list[tuple[nn.Parameter, tuple, tuple]], config: GroupConfig) -> None:
        self.config = config
        topology, strategy = config.topology, config.strategy
        self.device = topology.device
        self.main_device = torch.device("cpu") if config.offload else self.device
        self.layout_shards = topology.shard_size if strategy.shards_main_params else 1
        self.outer_shards = topology.replicate_size if config.outer_optim else 1
        numel = sum(param.numel() for param, _, _ in params)
        unit = self.layout_shards * self.outer_shards
        self.padded_numel = max(unit, -(-numel // unit) * unit)
        self.shard_numel = self.padded_numel // self.layout_shards
        self.inner_start = topology.shard_rank * self.shard_numel if self.layout_shards > 1 else 0
        owned_numel = self.shard_numel // self.outer_shards
        outer_index = topology.replicate_rank if self.outer_shards > 1 else 0
        self.owned_start = self.inner_start + outer_index * owned_numel
        self.owned_stop = self.owned_start + owned_numel

        self.slots: list[ParamSlot] = []
        offset = 0
        for param, owners, fqns in params:
            start = min(max(self.owned_start - offset, 0), param.numel())
            stop = max(min(self.owned_stop - offset, param.numel()), start)
            self.slots.append(
                ParamSlot(fqns, owners, param.shape, offset, param.numel(), param.requires_grad, start, stop)
            )
            offset += param.numel()

        with torch.no_grad():
            self._full = torch.zeros(self.padded_numel, dtype=config.compute_dtype, device=self.device)
            # Writes go through this alias, whose version counter is its own: refilling the
            # buffer must not look like an in-place change to tensors autograd saved.
            self._writable = self._full.data
            for slot, (param, _, _) in zip(self.slots, params, strict=True):
                self._writable[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            # Resident FP32 compute parameters double as main parameters: no second copy.
            self.main_in_full = (
                not strategy.shards_params and config.compute_dtype == torch.float32 and not config.offload
            )
            if self.main_in_full:
                self.main = self._full[self.owned_start : self.owned_stop]
            else:
                self.main = torch.zeros(owned_numel, dtype=torch.float32, device=self.main_device)
                for slot, (param, _, _) in zip(self.slots, params, strict=True):
                    piece = param.detach().reshape(-1)[slot.local_start : slot.local_stop]
                    self.main[self.main_range(slot)].copy_(piece)

        # The original parameter objects become the main parameters: an optimizer built on
        # them at any time, even before ``fully_shard``, steps the shards.
        self.main_params = [param for param, _, _ in params]
        with torch.no_grad():
            for slot, param in zip(self.slots, self.main_params, strict=True):
                param.grad = None
                param.data = self.main[self.main_range(slot)]
        self.unsharded_params = [
            nn.Parameter(
                self._full[slot.offset : slot.offset + slot.numel].view(slot.shape), slot.requires_grad
            )
            for slot in self.slots
        ]
        for index, param in enumerate(self.unsharded_params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p, index=index: self._on_grad(index, p))

        self._gather_input = self._make_gather_input()
        self._gather: Pending | None = None
        self._input_version: int | None = None
        self._full_version: int | None = self.main_version()
        self.resident = True
        # The main gradient buffer lives only as long as the main parameters' ``.grad`` views of
        # it: ``optimizer.zero_grad()`` (set to None) frees it, as it frees plain gradients.
        self._main_grad: weakref.ref | None = None
        self._grad_full: torch.Tensor | None = None  # gradients accumulated under no_sync
        self._grads: dict[int, torch.Tensor] = {}
        self._pending_grads: set[int] = set()
        self.on_grads_ready: Callable[[FlatParamGroup], None] | None = None
        # Called when the first gradient of a backward arrives, before it is kept.
        self.on_first_grad: Callable[[FlatParamGroup], None] | None = None
        self.has_trainable = any(slot.requires_grad for slot in self.slots)
        self.reshard()

    def main_range(self, slot: ParamSlot) -> slice:
        """Where ``slot``'s owned part lives in ``main`` (and in any owned-slice-sized tensor)."""
        start = slot.offset + slot.local_start - self.owned_start
        return slice(max(start, 0), max(start, 0) + slot.local_stop - slot.local_start)

    def main_version(self) -> int:
        """Grows whenever the main parameters are written, through ``main`` or a parameter."""
        # ``param.data = view`` gives a parameter the view's storage but not its version counter.
        return self.main._version + sum(param._version for param in self.main_params)

    def _make_gather_input(self) -> torch.Tensor | None:
        config = self.config
        if self.layout_shards == 1:
            return None
        if not config.strategy.shards_params:
            return self._writable[self.inner_start : self.inner_start + self.shard_numel]
        if config.compute_dtype == torch.float32 and not config.offload and self.outer_shards == 1:
            return self.main
        return torch.empty(self.shard_numel, dtype=config.compute_dtype, device=self.device)

    # -- parameters ---------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Make the full compute parameters current, gathering them if they are not."""
        if self._gather is None:
            version = self.main_version()
            if self.resident and self._full_version == version:
                return
            if self._full.untyped_storage().nbytes() == 0:
                self._full.untyped_storage().resize_(self.padded_numel * self._full.element_size())
            with torch.no_grad():
                if self._gather_input is None:
                    if not self.main_in_full:
                        self._writable.copy_(self.main)
                    self._gather = Pending(None)
                else:
                    if self._input_version != version:
                        self._refresh_gather_input()
                        self._input_version = version
                    self._gather = collectives.all_gather(
                        self._writable, self._gather_input, self.config.topology.shard_group, async_op=True
                    )
            self._full_version = version
        if not async_op:
            self.wait_unshard()

    def _refresh_gather_input(self) -> None:
        if self._gather_input is self.main or self.main_in_full:
            return
        if self.outer_shards > 1:
            owned = self.main.to(self.device, self.config.compute_dtype)
            collectives.all_gather(self._gather_input, owned, self.config.topology.replicate_group)
        else:
            self._gather_input.copy_(self.main)

    def wait_unshard(self) -> None:
        """Wait for an all-gather issued by ``unshard(async_op=True)``."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self.resident = True

    def reshard(self) -> None:
        """Free the full compute parameters (only when the strategy shards them)."""
        if not self.config.strategy.shards_params:
            return
        self.wait_unshard()
        self._full.untyped_storage().resize_(0)
        self.resident = False

    def expose(self, unsharded: bool) -> None:
        """Register the full compute parameters, or the FP32 main shards, on the owning modules."""
        params = self.unsharded_params if unsharded else self.main_params
        for slot, param in zip(self.slots, params, strict=True):
            for module, name in slot.owners:
                module._parameters[name] = param

    # -- gradients ----------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Expect a gradient for every trainable parameter in the coming backward."""
        self._pending_grads = {index for index, slot in enumerate(self.slots) if slot.requires_grad}

    @property
    def grads_pending(self) -> bool:
        return bool(self._pending_grads)

    def _on_grad(self, index: int, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        if grad is None:
            return
        if not self._grads and self.on_first_grad is not None:
            self.on_first_grad(self)
        # Kept as autograd produced it; packed into one flat buffer only once the unit's
        # gradients are complete and its parameters are freed, so the two never coexist.
        self._grads[index] = grad
        self._pending_grads.discard(index)
        if not self._pending_grads and self.on_grads_ready is not None:
            self.on_grads_ready(self)

    def _pack_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """Move this backward's gradients into the flat buffer (adding to accumulated ones)."""
        flat = self._grad_full
        if flat is None:
            flat = torch.empty(self.padded_numel, dtype=dtype, device=self.device)
            covered = 0
            for index, slot in enumerate(self.slots):
                if index not in self._grads:
                    flat[slot.offset : slot.offset + slot.numel].zero_()
                covered = slot.offset + slot.numel
            flat[covered:].zero_()
        with torch.no_grad():
            for index, grad in self._grads.items():
                slot = self.slots[index]
                target = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if self._grad_full is None:
                    target.copy_(grad)
                else:
                    target.add_(grad)
        self._grads = {}
        self._grad_full = None
        return flat

    def keep_grads_for_accumulation(self) -> None:
        """Hold the local gradients (in FP32) for the next backward instead of reducing them."""
        self._pending_grads = set()
        self._grad_full = self._pack_grads(torch.float32)

    def start_reduce(self) -> Pending:
        """Issue the reduction of the local gradients; ``wait()`` adds them to the main gradient."""
        self._pending_grads = set()
        config, topology = self.config, self.config.topology
        # Parameters that took no part in this backward contribute zeros, like on the peers.
        grad = self._pack_grads(config.reduce_dtype)
        with torch.no_grad():
            grad.div_(config.grad_divisor)
            grad = grad.to(config.reduce_dtype)
        if not config.strategy.shards_grads:
            first = collectives.all_reduce(grad, topology.shard_group, async_op=True)
            owned = grad[self.owned_start : self.owned_stop]
            return first.then(lambda: self._finish_reduce(owned))
        if config.fp32_accumulate_reduce_scatter and grad.dtype != torch.float32 and self.layout_shards > 1:
            received = torch.empty_like(grad)
            first = collectives.all_to_all(received, grad, topology.shard_group, async_op=True)
            pieces = received.view(self.layout_shards, -1)
            return first.then(lambda: self._finish_reduce(pieces.sum(0, dtype=torch.float32)))
        shard = torch.empty(self.shard_numel, dtype=grad.dtype, device=self.device)
        first = collectives.reduce_scatter(shard, grad, topology.shard_group, async_op=True)
        return first.then(lambda: self._finish_reduce(shard))

    def _finish_reduce(self, inner: torch.Tensor) -> None:
        """Reduce an inner-shard-sized gradient across the replicate group; add it to main grads."""
        topology = self.config.topology
        if topology.replicate_group is not None:
            if self.outer_shards > 1:
                owned = inner.new_empty(self.shard_numel // self.outer_shards)
                collectives.reduce_scatter(owned, inner, topology.replicate_group)
                inner = owned
            else:
                inner = inner.contiguous()
                collectives.all_reduce(inner, topology.replicate_group)
        self._accumulate_main_grad(inner)

    def _accumulate_main_grad(self, reduced: torch.Tensor) -> None:
        reduced = reduced.to(self.main_device, torch.float32)
        trainable = [
            (slot, param)
            for slot, param in zip(self.slots, self.main_params, strict=True)
            if slot.requires_grad
        ]
        main_grad = self._main_grad() if self._main_grad is not None else None
        with torch.no_grad():
            if (
                main_grad is None
                and reduced._base is None
                and all(param.grad is None for _, param in trainable)
            ):
                # Nothing to accumulate into: the reduced shard becomes the main gradient.
                main_grad, reduced = reduced, None
            elif main_grad is None:
                main_grad = torch.zeros_like(self.main)
            self._main_grad = weakref.ref(main_grad)
            for slot, param in trainable:
                view = main_grad[self.main_range(slot)]
                if reduced is not None and param.grad is None:
                    view.zero_()
                elif param.grad is not None and (
                    param.grad.data_ptr() != view.data_ptr() or param.grad.shape != view.shape
                ):
                    view.copy_(param.grad)
                param.grad = view
            if reduced is not None:
                main_grad.add_(reduced)

    # -- checkpoint support -------------------------------------------------------------------

    def gather_full(self, owned: torch.Tensor) -> torch.Tensor:
        """All-gather an owned-slice-sized tensor into the full padded flat tensor (on device)."""
        topology = self.config.topology
        piece = owned.to(self.device)
        if self.outer_shards > 1:
            inner = piece.new_empty(self.shard_numel)
            collectives.all_gather(inner, piece, topology.replicate_group)
            piece = inner
        if self.layout_shards == 1:
            return piece
        full = piece.new_empty(self.padded_numel)
        collectives.all_gather(full, piece, topology.shard_group)
        return full
