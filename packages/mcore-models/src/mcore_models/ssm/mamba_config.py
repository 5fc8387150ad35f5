"""``MambaConfig``: the sizes and initialisation of a Mamba-2 mixer, beside the model's
``TransformerConfig`` (hidden size, dtype, norm epsilon, parallelism). Field names are
Megatron-LM's, so they can join the training command line once hybrid models train there."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_api import experimental_api
from mcore_parallel import ConfigError, config_field, validate_fields


@experimental_api
@dataclass
class MambaConfig:
    """Mamba-2 mixer options. The inner width is ``mamba_num_heads * mamba_head_dim``, or
    ``mamba_expand * hidden_size`` without ``mamba_num_heads`` (see ``heads``)."""

    mamba_state_dim: int = config_field(128, minimum=1, help="SSM state size per head (d_state).")
    mamba_head_dim: int = config_field(64, minimum=1, help="Channels per SSM head.")
    mamba_num_groups: int = config_field(
        8, minimum=1, help="Groups of heads that share B and C (like GQA's key/value groups)."
    )
    mamba_num_heads: int | None = config_field(
        None,
        minimum=1,
        help="SSM heads; the inner width is heads * mamba_head_dim. "
        "Default: mamba_expand * hidden_size / mamba_head_dim.",
    )
    mamba_expand: int = config_field(
        2, minimum=1, help="Inner width = mamba_expand * hidden_size (when mamba_num_heads is unset)."
    )
    mamba_conv_kernel: int = config_field(4, minimum=1, help="Width of the depthwise causal convolution.")
    mamba_chunk_size: int = config_field(128, minimum=1, help="Chunk length of the SSD scan.")
    mamba_dt_min: float = config_field(
        0.001, minimum=0.0, help="Init: smallest initial time step (dt is log-uniform in [min, max])."
    )
    mamba_dt_max: float = config_field(0.1, minimum=0.0, help="Init: largest initial time step.")
    mamba_dt_init_floor: float = config_field(
        1e-4, minimum=0.0, help="Init: initial time steps are clamped to at least this."
    )
    mamba_a_init_min: float = config_field(
        1.0, minimum=0.0, help="Init: A = -a with a uniform in [mamba_a_init_min, mamba_a_init_max]."
    )
    mamba_a_init_max: float = config_field(16.0, minimum=0.0, help="Init: upper end of a's range.")
    mamba_dt_clamp_min: float = config_field(
        0.0,
        minimum=0.0,
        help="Forward: time steps below this are raised to it (Nemotron-H clamps at its "
        "time_step_min); 0: no clamp.",
    )
    mamba_dt_clamp_max: float | None = config_field(
        None,
        help="Forward: time steps above this are lowered to it (Hugging Face's time_step_limit[1]); "
        "must exceed mamba_dt_clamp_min. Default: no upper clamp.",
    )
    mamba_conv_init: float | None = config_field(
        None,
        help="Init: conv1d weight uniform in (-mamba_conv_init, mamba_conv_init), as Megatron-LM's and "
        "mamba_ssm's conv_init. Default: torch.nn.Conv1d's kaiming_uniform_(a=sqrt(5)).",
    )

    def __post_init__(self) -> None:
        for name in ("mamba_dt_clamp_max", "mamba_conv_init"):
            _check_positive_finite_or_none(name, getattr(self, name))
        validate_fields(self)
        if self.mamba_dt_clamp_max is not None and self.mamba_dt_clamp_max <= self.mamba_dt_clamp_min:
            raise ConfigError(
                ["mamba_dt_clamp_min", "mamba_dt_clamp_max"],
                f"need mamba_dt_clamp_min ({self.mamba_dt_clamp_min}) < mamba_dt_clamp_max "
                f"({self.mamba_dt_clamp_max})",
            )
        if not 0 < self.mamba_dt_min <= self.mamba_dt_max:
            raise ConfigError(
                ["mamba_dt_min", "mamba_dt_max"],
                f"need 0 < mamba_dt_min ({self.mamba_dt_min}) <= mamba_dt_max ({self.mamba_dt_max})",
            )
        if not 0 < self.mamba_a_init_min <= self.mamba_a_init_max:
            raise ConfigError(
                ["mamba_a_init_min", "mamba_a_init_max"],
                f"need 0 < mamba_a_init_min ({self.mamba_a_init_min}) <= mamba_a_init_max "
                f"({self.mamba_a_init_max})",
            )

    def heads(self, hidden_size: int) -> int:
        """The SSM heads of a mixer on ``hidden_size``: ``mamba_num_heads``, or ``mamba_expand *
        hidden_size / mamba_head_dim``.

        Raises:
            ConfigError: the inner width does not split into heads, or the heads into
                ``mamba_num_groups`` groups.
        """
        heads = self.mamba_num_heads
        if heads is None:
            inner = self.mamba_expand * hidden_size
            if inner % self.mamba_head_dim:
                raise ConfigError(
                    ["mamba_expand", "hidden_size", "mamba_head_dim"],
                    f"the inner width mamba_expand * hidden_size ({inner}) must be divisible by "
                    f"mamba_head_dim ({self.mamba_head_dim}) unless mamba_num_heads is set",
                )
            heads = inner // self.mamba_head_dim
        if heads % self.mamba_num_groups:
            raise ConfigError(
                ["mamba_num_heads", "mamba_num_groups"],
                f"the Mamba heads ({heads}) must be a multiple of mamba_num_groups ({self.mamba_num_groups})",
            )
        return heads


def _check_positive_finite_or_none(name: str, value: object) -> None:
    """``ConfigError`` naming ``name`` unless ``value`` is ``None`` or a finite number above 0."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ConfigError([name], f"must be a finite number > 0 or None, got {value!r}")
