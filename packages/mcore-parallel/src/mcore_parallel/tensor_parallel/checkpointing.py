"""Activation checkpointing that replays the forward with the random state it first ran with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .random import RNGStatesTracker, get_device_rng_state, get_rng_tracker, set_device_rng_state


class _RandomState:
    """The CPU generator, the tracker's device generator and the tracker's named streams."""

    def __init__(self, tracker: RNGStatesTracker):
        self.tracker = tracker
        self.cpu = torch.get_rng_state()
        self.device = get_device_rng_state(tracker.device) if tracker.device.type != "cpu" else None
        self.streams = tracker.get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            set_device_rng_state(self.device, self.tracker.device)
        self.tracker.set_states(self.streams)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, tracker, *args):
        ctx.function = function
        ctx.random_state = _RandomState(tracker)
        tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_positions = tensor_positions
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in tensor_positions))
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.non_tensor_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[position] = saved.detach().requires_grad_(saved.requires_grad)
        now = _RandomState(ctx.random_state.tracker)
        ctx.random_state.restore()
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            now.restore()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g) for o, g in zip(outputs, grads, strict=True) if torch.is_tensor(o) and o.requires_grad
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None, *input_grads)


def checkpoint(function: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None) -> Any:
    """``function(*args)`` without keeping its activations; they are recomputed during backward.

    The recomputation sees the random state the forward saw: the CPU generator, the device
    generator and every stream of ``tracker`` (default: the global one), so dropout masks match.
    Gradients flow to tensor arguments and to parameters ``function`` uses; as with any custom
    autograd function, at least one tensor argument must require grad for backward to reach it.
    """
    return _Checkpoint.apply(function, tracker if tracker is not None else get_rng_tracker(), *args)
