"""Runtime of a sharded model: the forward and backward hooks of its sharding units, prefetch
order, deferred release under activation recompute, and gradient-reduction scheduling."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from mcore_fsdp.collectives import Pending
from mcore_fsdp.flat_param_group import FlatParamGroup

# Reductions left in flight once a new one is issued (the new one included); see also
# ``ShardingState._first_grad``.
_MAX_REDUCTIONS_IN_FLIGHT = 1


class ShardingUnit:
    """A module whose parameters are gathered together before its forward and backward."""

    def __init__(self, module: nn.Module, groups: list[FlatParamGroup], is_root: bool) -> None:
        self.module = module
        self.groups = groups
        self.is_root = is_root

    def unshard(self, async_op: bool = False) -> None:
        for group in self.groups:
            group.unshard(async_op=async_op)

    def expose(self, unsharded: bool) -> None:
        for group in self.groups:
            group.expose(unsharded)

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()
            group.expose(unsharded=False)


def _tensors_in(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def _cast_floating(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _cast_floating(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast_floating(item, dtype) for item in value)
    return value


class ShardingState:
    """Drives the units of one sharded model through forward, backward and gradient sync."""

    def __init__(self, units: list[ShardingUnit], input_dtype: torch.dtype | None, prefetch: bool) -> None:
        self.units = units
        self.groups = [group for unit in units for group in unit.groups]
        self.input_dtype = input_dtype
        self.prefetch = prefetch
        self.sync_grads = True
        self.in_backward = False
        self._forward_order: list[ShardingUnit] = []
        self._order_index: dict[int, int] = {}
        self._order_frozen = False
        self._reductions: list[Pending] = []
        self._unit_of = {id(group): unit for unit in units for group in unit.groups}
        for group in self.groups:
            group.on_grads_ready = self._grads_ready
            group.on_first_grad = self._first_grad
        for unit in units:
            unit.module.register_forward_pre_hook(
                lambda module, args, kwargs, unit=unit: self._pre_forward(unit, args, kwargs),
                with_kwargs=True,
                prepend=True,
            )
            unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output),
            )

    # -- forward ------------------------------------------------------------------------------

    def _neighbour(self, unit: ShardingUnit, step: int) -> ShardingUnit | None:
        if not (self.prefetch and self._order_frozen):
            return None
        index = self._order_index.get(id(unit))
        if index is None or not 0 <= index + step < len(self._forward_order):
            return None
        return self._forward_order[index + step]

    def _pre_forward(self, unit: ShardingUnit, args, kwargs):
        if unit.is_root and not self.in_backward:
            self.finish_reductions()
            if self.input_dtype is not None:
                args, kwargs = (
                    _cast_floating(args, self.input_dtype),
                    _cast_floating(kwargs, self.input_dtype),
                )
        if not self._order_frozen and not self.in_backward and id(unit) not in self._order_index:
            self._order_index[id(unit)] = len(self._forward_order)
            self._forward_order.append(unit)
        unit.unshard()
        unit.expose(unsharded=True)
        if not self.in_backward:
            following = self._neighbour(unit, +1)
            if following is not None:
                following.unshard(async_op=True)
        return args, kwargs

    def _post_forward(self, unit: ShardingUnit, output):
        if torch.is_grad_enabled():
            needing_grad = [tensor for tensor in _tensors_in(output) if tensor.requires_grad]
            if needing_grad:
                register_multi_grad_hook(needing_grad, lambda grads: self._pre_backward(unit), mode="any")
        # Under activation recompute the forward runs again inside backward; the unit stays
        # resident until its gradients are done (deferred release), so it is not gathered twice.
        if not self.in_backward:
            if not unit.is_root:
                unit.reshard()
            elif not torch.is_grad_enabled():
                for each in self.units:
                    each.expose(unsharded=False)
        return output

    # -- backward -----------------------------------------------------------------------------

    def _pre_backward(self, unit: ShardingUnit) -> None:
        if not self.in_backward:
            self.in_backward = True
            for group in self.groups:
                group.begin_backward()
            Variable._execution_engine.queue_callback(self._end_backward)
        unit.unshard()
        unit.expose(unsharded=True)

    def _first_grad(self, group: FlatParamGroup) -> None:
        """A unit's gradients start to arrive: retire the previous unit's reduction, then
        prefetch the unit whose backward comes next.

        The reduction overlapped the start of this unit's backward; its buffer is freed before
        this unit's gradients and the next unit's parameters take memory, so one unit's
        parameters and gradients, the next unit's parameters and the buffer being reduced are
        never all resident at once.
        """
        self.finish_reductions()
        previous = self._neighbour(self._unit_of[id(group)], -1)
        if previous is not None:
            previous.unshard(async_op=True)

    def _grads_ready(self, group: FlatParamGroup) -> None:
        # Free the gathered parameters first: the flat gradient buffer is allocated next.
        group.reshard()
        group.expose(unsharded=False)
        if self.sync_grads:
            self._reductions.append(group.start_reduce())
            while len(self._reductions) > _MAX_REDUCTIONS_IN_FLIGHT:
                self._reductions.pop(0).wait()
        else:
            group.keep_grads_for_accumulation()

    def _end_backward(self) -> None:
        # Parameters that took no part in this backward still join the reduction (as zeros),
        # so every rank issues the same collectives in the same order.
        for group in self.groups:
            if group.has_trainable and group.grads_pending:
                self._grads_ready(group)
        self.finish_reductions()
        for unit in self.units:
            unit.reshard()
        self.in_backward = False
        self._order_frozen = bool(self._forward_order)

    def finish_reductions(self) -> None:
        """Wait for every gradient reduction in flight and add the results to main gradients."""
        while self._reductions:
            self._reductions.pop(0).wait()
