"""Weight initialisers derived from the config."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from ..config.transformer_config import TransformerConfig

InitMethod = Callable[[torch.Tensor], object]


def init_method(config: TransformerConfig) -> InitMethod:
    """Normal(0, ``init_method_std``)."""
    return partial(torch.nn.init.normal_, mean=0.0, std=config.init_method_std)


def output_init_method(config: TransformerConfig) -> InitMethod:
    """For layers that write into the residual stream: the std divided by ``sqrt(2 * num_layers)``
    when ``use_scaled_init_for_output``."""
    std = config.init_method_std
    if config.use_scaled_init_for_output:
        std = std / math.sqrt(2.0 * config.num_layers)
    return partial(torch.nn.init.normal_, mean=0.0, std=std)
