"""The learning rate as a function of the iteration: warm-up, then constant, linear, cosine or WSD.

A pure function of the iteration, so a resumed run follows the same schedule without saved state.
"""

from __future__ import annotations

import math

from .config import SchedulerConfig


def learning_rate(iteration: int, peak_lr: float, config: SchedulerConfig, train_iters: int) -> float:
    """The learning rate of 1-based ``iteration``.

    Warm-up rises linearly to ``peak_lr`` over ``lr_warmup_iters``; afterwards the rate falls to
    ``min_lr`` at ``lr_decay_iters`` (default ``train_iters``) and stays there. ``WSD`` holds
    ``peak_lr`` until the last ``lr_wsd_decay_iters`` of the decay span, then decays.
    """
    warmup = config.lr_warmup_iters
    if iteration <= warmup:
        return peak_lr * iteration / max(warmup, 1)
    if config.lr_decay_style == "constant":
        return peak_lr
    decay_end = config.lr_decay_iters or train_iters
    if iteration >= decay_end:
        return config.min_lr
    span = max(decay_end - warmup, 1)
    if config.lr_decay_style == "WSD":
        decay_iters = config.lr_wsd_decay_iters or max(1, round(0.2 * span))
        decay_start = decay_end - min(decay_iters, span)
        if iteration <= decay_start:
            return peak_lr
        progress = (iteration - decay_start) / (decay_end - decay_start)
        style = config.lr_wsd_decay_style
    else:
        progress = (iteration - warmup) / span
        style = config.lr_decay_style
    if style == "linear":
        fraction = 1.0 - progress
    else:  # cosine
        fraction = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + (peak_lr - config.min_lr) * fraction


class LearningRateSchedule:
    """The schedule of a run as a component: ``apply(optimizer, iteration)`` sets the rate of every
    parameter group. It keeps no state (a resumed run recomputes it from the iteration)."""

    def __init__(self, peak_lr: float, config: SchedulerConfig, train_iters: int):
        self.peak_lr, self.config, self.train_iters = peak_lr, config, train_iters

    def __call__(self, iteration: int) -> float:
        """The learning rate of 1-based ``iteration`` (see ``learning_rate``)."""
        return learning_rate(iteration, self.peak_lr, self.config, self.train_iters)

    def apply(self, optimizer, iteration: int) -> float:
        """Set ``iteration``'s rate in ``optimizer.param_groups``; returns it."""
        lr = self(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
