"""Adam or AdamW from an ``OptimizerConfig``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config.optimizer import OptimizerConfig


def build_adam_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict], config: OptimizerConfig
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` (``decoupled_weight_decay``) or ``torch.optim.Adam`` with the
    learning rate, betas, epsilon and weight decay of ``config``."""
    adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    return adam(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
