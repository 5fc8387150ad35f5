"""``DistributedDataParallelConfig``: how gradients are bucketed and reduced across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import ConfigError, config_field, validate_fields


@dataclass
class DistributedDataParallelConfig:
    """Data parallelism: gradient buffer dtype, buckets, overlap with backward and the reduction."""

    grad_reduce_in_fp32: bool = config_field(
        False, help="Accumulate and reduce gradients in float32 whatever the parameter dtype."
    )
    overlap_grad_reduce: bool = config_field(
        False, help="Start each bucket's reduction from backward hooks as soon as its gradients are ready."
    )
    use_distributed_optimizer: bool = config_field(
        False, help="Reduce-scatter gradients and shard the optimizer state across data-parallel ranks."
    )
    bucket_size: int | None = config_field(
        None,
        minimum=1,
        flag="--ddp-bucket-size",
        help="Gradient elements per bucket (default: one bucket per parameter dtype).",
    )
    grad_reduce_op: Literal["average", "sum"] = config_field(
        "average", help="Average the gradients over data-parallel ranks, or sum them."
    )
    reduce_scatter_with_fp32_accumulation: bool = config_field(
        False,
        help="Reduce-scatter as an all-to-all followed by a local float32 sum (distributed optimizer only).",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ConfigError(
                ["reduce_scatter_with_fp32_accumulation", "use_distributed_optimizer"],
                "float32-accumulating reduce-scatter needs the distributed optimizer",
            )
