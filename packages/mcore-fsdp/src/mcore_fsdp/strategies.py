"""Sharding strategies: what each data-parallel rank keeps only a shard of."""

from __future__ import annotations

from enum import StrEnum

from mcore_fsdp.errors import FSDPConfigError


class ShardingStrategy(StrEnum):
    """What is sharded across the data-parallel shard group.

    ``no_shard``: nothing (plain data parallelism, gradients all-reduced).
    ``optim``: optimizer state and main parameters (gradients all-reduced, ZeRO-1).
    ``optim_grads``: also gradients (reduce-scattered, ZeRO-2).
    ``optim_grads_params``: also the compute parameters, gathered per unit on use (ZeRO-3).
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, value: ShardingStrategy | str, argument: str = "strategy") -> ShardingStrategy:
        """Return the strategy named by ``value``; raise ``FSDPConfigError`` naming ``argument``."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in cls)
            raise FSDPConfigError(f"{argument} must be one of {allowed}; got {value!r}") from None

    @property
    def shards_main_params(self) -> bool:
        """Whether each rank keeps only a shard of the FP32 main parameters and optimizer state."""
        return self is not ShardingStrategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        """Whether gradients are reduce-scattered rather than all-reduced."""
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Whether compute parameters are freed after use and gathered again before the next."""
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS


#: Strategies allowed across the outer (replicate) dimension of a hybrid mesh.
OUTER_STRATEGIES = (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)
