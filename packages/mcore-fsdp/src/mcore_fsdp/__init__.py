"""Fully sharded data parallelism for any ``torch.nn.Module``. Depends only on torch, so it
installs alone into any trainer.

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())  # FP32 main-parameter shards
"""

from importlib.metadata import version as _version

from mcore_fsdp.collectives import count_collectives
from mcore_fsdp.errors import CheckpointMismatchError, FSDPConfigError
from mcore_fsdp.fully_shard import FSDPModule, fully_shard
from mcore_fsdp.optimizer_state import load_optimizer_state_dict, optimizer_state_dict
from mcore_fsdp.precision import MixedPrecision
from mcore_fsdp.state_dict import LoadResult
from mcore_fsdp.strategies import ShardingStrategy

__version__ = _version("mcore-fsdp")

__all__ = [
    "CheckpointMismatchError",
    "FSDPConfigError",
    "FSDPModule",
    "LoadResult",
    "MixedPrecision",
    "ShardingStrategy",
    "__version__",
    "count_collectives",
    "fully_shard",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
]
