"""``--fsdp``: fully sharded data parallelism from the optional ``mcore-fsdp`` package.

The ``GPTModel`` is sharded with ``mcore_fsdp.fully_shard`` over the data-parallel group, each
``TransformerLayer`` a sharding unit (embedding and output layer form the root unit). Adam/AdamW
runs on the FP32 main-parameter shards and clips with the model's ``clip_grad_norm_``; checkpoints
are the model's DTensor ``state_dict`` and ``optimizer_state_dict``, so they load at any number of
ranks and any strategy. ``mcore_fsdp`` is imported only here, only when ``--fsdp`` is given.
"""

from __future__ import annotations

import math

import torch
from mcore_parallel import (
    ConfigError,
    OptimizerConfig,
    ProcessGroupCollection,
    build_adam_optimizer,
    model_parallel_manual_seed,
)

from ..models.gpt.model import GPTModel
from ..transformer.layer import TransformerLayer
from .config import TrainConfigs, TrainModelConfig
from .extras import import_extra
from .model_setup import TrainModel

FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def check_fsdp_available() -> None:
    """Raise a clear error when ``mcore_fsdp`` is not installed.

    Raises:
        ConfigError: naming ``fsdp`` and how to install it.
    """
    import_extra("mcore_fsdp", "fsdp", "--fsdp", "mcore-fsdp", "fsdp")


def check_fsdp_layout(configs: TrainConfigs) -> None:
    """``--fsdp`` shards over data- (and context-) parallel ranks only, and reduces gradients its own way.

    Raises:
        ConfigError: TP, PP or VPP above 1, the distributed optimizer, gradient logging, a DDP
            bucket size or summed gradients, or a partial optimizer offload with ``--fsdp``.
    """
    model = configs.model
    if (
        model.tensor_model_parallel_size != 1
        or model.pipeline_model_parallel_size != 1
        or model.virtual_pipeline_model_parallel_size is not None
    ):
        raise ConfigError(
            ["fsdp", "tensor_model_parallel_size", "pipeline_model_parallel_size"],
            "--fsdp needs TP = PP = 1 (it shards over data- and context-parallel ranks only)",
        )
    if configs.ddp.use_distributed_optimizer:
        raise ConfigError(
            ["fsdp", "use_distributed_optimizer"],
            "--fsdp shards the optimizer state itself; drop --use-distributed-optimizer",
        )
    if configs.training.save_grads_interval:
        raise ConfigError(["fsdp", "save_grads_interval"], "gradient logging is not supported with --fsdp")
    ddp = configs.ddp
    if ddp.bucket_size is not None or ddp.grad_reduce_op != "average":
        raise ConfigError(
            ["fsdp", "bucket_size", "grad_reduce_op"],
            "--fsdp reduce-scatters each layer's gradients as one unit and averages them; "
            "drop --ddp-bucket-size and --grad-reduce-op",
        )
    optimizer = configs.optimizer
    if optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction != 1.0:
        raise ConfigError(
            ["fsdp", "optimizer_offload_fraction"],
            "--fsdp offloads all of the optimizer state or none: drop --optimizer-offload-fraction",
        )


def build_fsdp_train_model(
    config: TrainModelConfig,
    vocab_size: int,
    groups: ProcessGroupCollection,
    strategy: str,
    seed: int,
    offload_optimizer: bool = False,
) -> TrainModel:
    """The whole ``GPTModel`` (same initial weights as ``build_train_model`` at TP = PP = 1), sharded;
    with ``offload_optimizer`` its FP32 main parameters, gradients and so the optimizer state live
    on the CPU.

    ``TrainModel.ddp`` is the sharded model itself: its ``no_sync`` is what the schedule uses.
    """
    from mcore_fsdp import MixedPrecision, fully_shard

    model_parallel_manual_seed(seed, 0)
    model = GPTModel(config, vocab_size, pg_collection=groups)
    dtype = config.params_dtype
    precision = (
        None if dtype == torch.float32 else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    )
    # context-parallel ranks hold replicas too: shard over them as over data-parallel ranks
    fully_shard(
        model,
        mesh=groups.dp_cp if model.cp_group is not None else groups.dp,
        unit_classes=(TransformerLayer,),
        strategy=strategy,
        precision=precision,
        offload_optimizer=offload_optimizer,
    )
    return TrainModel([model], torch.nn.ModuleList([model]), model)


class FSDPOptimizer:
    """Adam/AdamW on the sharded model's FP32 main-parameter shards, clipped by the global norm."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig):
        self.model, self.config = model, config
        self.optimizer = build_adam_optimizer(model.parameters(), config)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip (``clip_grad`` 0: norm only), step; returns the norm before clipping."""
        norm = self.model.clip_grad_norm_(self.config.clip_grad or math.inf)
        self.optimizer.step()
        return float(norm)


def fsdp_checkpoint_state(model: TrainModel, optimizer: FSDPOptimizer, with_optimizer: bool = True) -> dict:
    """``{"model": DTensor state dict, "optimizer": optimizer_state_dict}`` for ``torch.distributed.checkpoint``
    (collective)."""
    from mcore_fsdp import optimizer_state_dict

    sharded = model.chunks[0]
    state = {"model": sharded.state_dict()}
    if with_optimizer:
        state["optimizer"] = optimizer_state_dict(sharded, optimizer.optimizer)
    return state


def load_fsdp_checkpoint_state(model: TrainModel, optimizer: FSDPOptimizer, state: dict) -> None:
    """Load what ``DistributedCheckpointer.load`` filled into ``fsdp_checkpoint_state``'s dict."""
    from mcore_fsdp import load_optimizer_state_dict

    sharded = model.chunks[0]
    sharded.load_state_dict(state["model"])
    if "optimizer" in state:
        load_optimizer_state_dict(sharded, optimizer.optimizer, state["optimizer"])


def fsdp_full_model(model: TrainModel, config: TrainModelConfig, groups: ProcessGroupCollection) -> GPTModel:
    """An unsharded ``GPTModel`` holding the sharded model's gathered weights (collective)."""
    full = model.chunks[0].full_state_dict()
    plain = GPTModel(config, model.chunks[0].vocab_size, pg_collection=groups)
    plain.load_state_dict(full)
    return plain
