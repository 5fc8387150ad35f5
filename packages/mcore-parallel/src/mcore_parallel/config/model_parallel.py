"""``ModelParallelConfig``: how a model is split across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..process_groups.layout import DEFAULT_ORDER
from .fields import ConfigError, config_field, validate_fields


@dataclass
class ModelParallelConfig:
    """Model parallelism: tensor, pipeline, context and expert parallel sizes and precision."""

    tensor_model_parallel_size: int = config_field(
        1, minimum=1, help="Ranks that split each layer's weights."
    )
    pipeline_model_parallel_size: int = config_field(
        1, minimum=1, help="Pipeline stages the layers are split into."
    )
    virtual_pipeline_model_parallel_size: int | None = config_field(
        None, minimum=1, help="Model chunks per pipeline stage for the interleaved schedule."
    )
    context_parallel_size: int = config_field(
        1, minimum=1, help="Ranks that split each sequence in attention."
    )
    expert_model_parallel_size: int = config_field(
        1, minimum=1, help="Ranks that split the experts of MoE layers."
    )
    expert_tensor_parallel_size: int | None = config_field(
        None,
        minimum=1,
        help="Ranks that split each MoE expert (FC1 by rows, FC2 by columns); unset: experts whole on every "
        "tensor-parallel rank (the expert grid then takes the tensor-parallel size).",
    )
    sequence_parallel: bool = config_field(
        False, help="Split activations outside tensor-parallel regions along the sequence."
    )
    parallel_order: str = config_field(
        DEFAULT_ORDER, help="Order of the parallel dimensions on the rank grid, fastest-varying first."
    )
    fp16: bool = config_field(False, help="Keep parameters and compute in float16.")
    bf16: bool = config_field(False, help="Keep parameters and compute in bfloat16.")

    def __post_init__(self) -> None:
        validate_fields(self)
        if sorted(self.parallel_order.split("-")) != ["cp", "dp", "ep", "pp", "tp"]:
            raise ConfigError(
                ["parallel_order"], f"must be a permutation of tp-cp-ep-dp-pp, got {self.parallel_order!r}"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                ["sequence_parallel", "tensor_model_parallel_size"],
                "sequence parallelism needs a tensor-parallel size > 1",
            )
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size < 2:
            raise ConfigError(
                ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"],
                "interleaving needs at least 2 pipeline stages",
            )
        if self.fp16 and self.bf16:
            raise ConfigError(["fp16", "bf16"], "choose at most one of float16 and bfloat16")

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameter dtype ``fp16``/``bf16`` select (float32 when neither is set)."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
