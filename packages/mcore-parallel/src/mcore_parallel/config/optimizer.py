"""``OptimizerConfig``: the Adam/AdamW hyper-parameters and where the optimizer state lives."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, config_field, validate_fields


@dataclass
class OptimizerConfig:
    """Optimizer: Adam or AdamW on float32 main parameters, gradient clipping and CPU offload."""

    lr: float = config_field(1e-4, minimum=0.0, help="Learning rate.")
    weight_decay: float = config_field(0.01, minimum=0.0, help="Weight-decay coefficient.")
    decoupled_weight_decay: bool = config_field(
        True, help="AdamW (decay applied to the weights) instead of Adam (decay added to the gradient)."
    )
    adam_beta1: float = config_field(0.9, minimum=0.0, help="Adam's first-moment decay.")
    adam_beta2: float = config_field(0.999, minimum=0.0, help="Adam's second-moment decay.")
    adam_eps: float = config_field(1e-8, minimum=0.0, help="Adam's denominator epsilon.")
    clip_grad: float = config_field(
        0.0, minimum=0.0, help="Clip the global gradient norm to this value (0: no clipping)."
    )
    optimizer_cpu_offload: bool = config_field(
        False, help="Keep (a fraction of) the float32 main parameters and optimizer state on the CPU."
    )
    optimizer_offload_fraction: float = config_field(
        1.0, minimum=0.0, help="Fraction of the optimizer state offloaded with --optimizer-cpu-offload."
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        for name in ("adam_beta1", "adam_beta2"):
            if not getattr(self, name) < 1.0:
                raise ConfigError([name], f"must be in [0, 1), got {getattr(self, name)}")
        if self.optimizer_offload_fraction > 1.0:
            raise ConfigError(
                ["optimizer_offload_fraction"], f"must be in [0, 1], got {self.optimizer_offload_fraction}"
            )
