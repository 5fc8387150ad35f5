"""Runtime of a sharded model: the forward and backward hooks of its sharding units, prefetch
order, deferred release under activation recompute, and gradient-reduction scheduling."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from mcore_fsdp import enclosing
from mcore_fsdp.collectives import Pending
from mcore_fsdp.flat_param_group import FlatParamGroup
from mcore_fsdp.settings import ShardSettings

# Reductions left in flight once a new one is issued (the new one included); see also
# ``ShardingState._first_grad``.
_MAX_REDUCTIONS_IN_FLIGHT = 1


class ShardingUnit:
    """A module whose parameters are gathered together before its forward and backward.

    Its hooks run on whichever ``ShardingState`` it belongs to now: the state of its own
    ``fully_shard`` call, until a later call on an enclosing module adopts it.
    """

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatParamGroup],
        settings: ShardSettings,
        reshard_after_forward: bool | None,
    ) -> None:
        self.module = module
        self.module_class = type(module)  # before fully_shard mixes FSDPModule into it
        self.groups = groups
        self.settings = settings
        # ``None``: reshard unless this unit is the root of its state.
        self.requested_reshard_after_forward = reshard_after_forward
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.sync_grads = True
        self.is_root = False
        self.state: ShardingState | None = None
        module.register_forward_pre_hook(
            lambda module, args, kwargs: self.state._pre_forward(self, args, kwargs),
            with_kwargs=True,
            prepend=True,
        )
        module.register_forward_hook(lambda module, args, output: self.state._post_forward(self, output))

    def attach(self, state: ShardingState, is_root: bool) -> None:
        """Run this unit's hooks on ``state``."""
        self.state = state
        self.is_root = is_root
        requested = self.requested_reshard_after_forward
        self.reshard_after_forward = (not is_root) if requested is None else requested

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
    """Drives the units of one sharded model through forward, backward and gradient sync.

    ``units[0]`` is the root: the module ``fully_shard`` was called on last.
    """

    def __init__(self, units: list[ShardingUnit]) -> None:
        root = units[0]
        self.units = units
        self.groups = [group for unit in units for group in unit.groups]
        precision = root.settings.precision
        self.input_dtype = precision.param_dtype if precision.cast_forward_inputs else None
        self.prefetch = root.settings.prefetch
        self.is_last_backward = True
        self.in_backward = False
        self.collecting_state_dict = False
        self._checked_enclosing = False
        self._forward_order: list[ShardingUnit] = []
        self._order_index: dict[int, int] = {}
        self._order_frozen = False
        self._reductions: list[Pending] = []
        self._unit_of = {id(group): unit for unit in units for group in unit.groups}
        for group in self.groups:
            group.on_grads_ready = self._grads_ready
            group.on_first_grad = self._first_grad
        for unit in units:
            if unit.state is not None:  # adopted from an earlier call's state
                unit.state.finish_reductions()
            unit.attach(self, is_root=unit is root)

    # -- forward ------------------------------------------------------------------------------

    def _neighbour(self, unit: ShardingUnit, step: int) -> ShardingUnit | None:
        if not (self.prefetch and self._order_frozen):
            return None
        index = self._order_index.get(id(unit))
        if index is None or not 0 <= index + step < len(self._forward_order):
            return None
        return self._forward_order[index + step]

    def _pre_forward(self, unit: ShardingUnit, args, kwargs):
        if unit.is_root and not self._checked_enclosing:
            enclosing.check_no_unmanaged_enclosing(unit.module)
            self._checked_enclosing = True
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
            if unit.reshard_after_forward:
                unit.reshard()
            elif unit.is_root and not torch.is_grad_enabled():
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
        unit = self._unit_of[id(group)]
        # Free the gathered parameters first: the flat gradient buffer is allocated next.
        if unit.reshard_after_backward:
            group.reshard()
        group.expose(unsharded=False)
        if unit.sync_grads:
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
        if self.is_last_backward:
            self.finish_reductions()
        else:
            _finish_before_optimizer_steps(self)
        for unit in self.units:
            if unit.reshard_after_backward:
                unit.reshard()
            else:
                unit.expose(unsharded=False)
        self.in_backward = False
        self._order_frozen = bool(self._forward_order)

    def finish_reductions(self) -> None:
        """Wait for every gradient reduction in flight and add the results to main gradients."""
        while self._reductions:
            self._reductions.pop(0).wait()


# States whose last reduction of a backward that was not the last one is still in flight.
_UNFINISHED: weakref.WeakSet[ShardingState] = weakref.WeakSet()
_optimizer_hook: RemovableHandle | None = None


def _finish_before_optimizer_steps(state: ShardingState) -> None:
    """Have every optimizer's next ``step()`` finish ``state``'s reductions first."""
    global _optimizer_hook
    _UNFINISHED.add(state)
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_finish_unfinished)


def _finish_unfinished(optimizer, args, kwargs) -> None:
    for state in list(_UNFINISHED):
        state.finish_reductions()
    _UNFINISHED.clear()
