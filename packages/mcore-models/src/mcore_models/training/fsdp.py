"""``--fsdp``: fully sharded data parallelism from the optional ``mcore-fsdp`` package.

The ``GPTModel`` is sharded with ``mcore_fsdp.fully_shard`` over the data-parallel group, each
``TransformerLayer`` (``HybridLayer``) a sharding unit (embedding and output layer form the root
unit). Adam/AdamW runs on the FP32 main-parameter shards and clips with the model's
``clip_grad_norm_``; checkpoints are the model's DTensor ``state_dict`` and ``optimizer_state_dict``, so they load at any number of
ranks and any strategy. With pipeline parallelism each stage shards its own part, and checkpoints
name its layers globally (see ``fsdp_pipeline``), so any pipeline size loads them. With tensor
parallelism each rank shards its slices over the data-parallel group; the gradient norm counts each slice once and the parameters TP replicates once, and
checkpoints hold the slices whole (see ``fsdp_tensor_parallel``), so any tensor-parallel size loads
them. With expert (or expert-tensor) parallelism the experts shard over the
expert-data-parallel group, their gradients scaled as DDP scales them, the gradient norm counts
each expert slice once, and checkpoints name them globally and whole (see ``fsdp_experts``), so
any expert-parallel and expert-tensor-parallel size loads them. ``mcore_fsdp`` is imported only
here, only when ``--fsdp`` is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from mcore_parallel import (
    ConfigError,
    OptimizerConfig,
    ProcessGroupCollection,
    build_adam_optimizer,
    get_group_device,
    model_parallel_manual_seed,
)

from ..models.gpt.model import GPTModel
from ..models.hybrid.layer import HybridLayer
from ..transformer.layer import TransformerLayer
from .config import TrainConfigs, TrainModelConfig
from .extras import import_extra
from .fsdp_experts import ExpertCheckpointNames
from .fsdp_pipeline import StageLayerNames
from .fsdp_tensor_parallel import TensorParallelNames
from .model_setup import TrainModel, build_model

FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def check_fsdp_available() -> None:
    """Raise a clear error when ``mcore_fsdp`` is not installed.

    Raises:
        ConfigError: naming ``fsdp`` and how to install it.
    """
    import_extra("mcore_fsdp", "fsdp", "--fsdp", "mcore-fsdp", "fsdp")


def check_fsdp_layout(configs: TrainConfigs) -> None:
    """``--fsdp`` shards one model chunk per pipeline stage, and reduces gradients its own way.

    Raises:
        ConfigError: virtual pipeline stages, the distributed optimizer, gradient logging, a DDP
            bucket size or summed gradients, or a partial optimizer offload with ``--fsdp``.
    """
    if configs.model.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            ["fsdp", "virtual_pipeline_model_parallel_size"],
            "--fsdp shards one model chunk per pipeline stage: drop "
            "--virtual-pipeline-model-parallel-size (PP without virtual stages works)",
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


@dataclass
class FSDPTrainModel(TrainModel):
    """A ``TrainModel`` whose ``ddp`` is the sharded model; ``expert_names`` (with expert
    parallelism) names its experts globally in checkpoints, ``tp_names`` (with tensor parallelism)
    holds its tensor-parallel slices whole there, ``stage_names`` (with pipeline parallelism) names
    its layers globally."""

    expert_names: ExpertCheckpointNames | None = None
    tp_names: TensorParallelNames | None = None
    stage_names: StageLayerNames | None = None

    @property
    def names(self) -> list:
        """The checkpoint-name converters in use, in the order they apply to local names: experts,
        tensor-parallel slices, then the stage's layers."""
        converters = (self.expert_names, self.tp_names, self.stage_names)
        return [names for names in converters if names is not None]

    def checkpoint_state(self, optimizer, tp_group=None, *, with_optimizer: bool = True, loading=None):
        """The ``Stateful`` checkpoint component: the DTensor state dicts (``FSDPCheckpoint``)."""
        return FSDPCheckpoint(self, optimizer, with_optimizer=with_optimizer)


def build_fsdp_train_model(
    config: TrainModelConfig,
    vocab_size: int,
    groups: ProcessGroupCollection,
    strategy: str,
    seed: int,
    offload_optimizer: bool = False,
) -> FSDPTrainModel:
    """This stage's ``GPTModel`` (same initial weights as ``build_train_model`` without virtual
    stages; with TP, this rank's slices), sharded; with ``offload_optimizer`` its FP32 main parameters, gradients and so
    the optimizer state live on the CPU. With expert (or expert-tensor) parallelism the experts
    (slices) shard over ``groups.expert_dp`` and their gradients are divided by the data-parallel
    size, as DDP divides them.

    ``TrainModel.ddp`` is the sharded model itself: its ``no_sync`` is what the schedule uses.
    """
    from mcore_fsdp import MixedPrecision, fully_shard

    pp, stage = dist.get_world_size(groups.pp), dist.get_rank(groups.pp)
    model_parallel_manual_seed(seed + 100 * stage, dist.get_rank(groups.tp))
    model = build_model(
        config, vocab_size, pre_process=stage == 0, post_process=stage == pp - 1, pg_collection=groups
    )
    dtype = config.params_dtype
    precision = (
        None if dtype == torch.float32 else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    )
    # context-parallel ranks hold replicas too: shard over them as over data-parallel ranks
    mesh = groups.dp_cp if model.cp_group is not None else groups.dp
    experts, names = {}, None
    if any(group is not None and dist.get_world_size(group) > 1 for group in (groups.ep, groups.expert_tp)):
        # the expert-(tensor-)parallel exchange brings every data-parallel rank's tokens to the experts
        experts = dict(
            expert_parameters=lambda name, param: getattr(param, "expert_parallel", False),
            expert_mesh=groups.expert_dp,
            expert_gradient_divide_factor=dist.get_world_size(mesh),
        )
        names = ExpertCheckpointNames(model, groups.ep, groups.expert_dp, groups.expert_tp)
    tp_names = TensorParallelNames(model, groups.tp, mesh) if dist.get_world_size(groups.tp) > 1 else None
    stage_names = StageLayerNames(model) if pp > 1 else None
    fully_shard(
        model,
        mesh=mesh,
        unit_classes=(TransformerLayer, HybridLayer),
        strategy=strategy,
        precision=precision,
        offload_optimizer=offload_optimizer,
        **experts,
    )
    return FSDPTrainModel([model], torch.nn.ModuleList([model]), model, names, tp_names, stage_names)


class FSDPOptimizer:
    """Adam/AdamW on the sharded model's FP32 main-parameter shards, clipped by the global norm
    (each tensor that ``names`` say tensor- or expert-tensor-parallel ranks share counted once)."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig, names: list | None = None):
        self.model, self.config = model, config
        self.names = names or []
        self.optimizer = build_adam_optimizer(model.parameters(), config)

    def copies_outside(self, param: torch.nn.Parameter) -> int:
        """How many ranks outside ``param``'s mesh hold its gradient (1: only this one)."""
        return math.prod(names.copies_outside_mesh(param) for names in self.names)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip (``clip_grad`` 0: norm only), step; returns the norm before clipping."""
        norm = self.model.clip_grad_norm_(
            self.config.clip_grad or math.inf, copies_outside=self.copies_outside
        )
        self.optimizer.step()
        return float(norm)


def _chained(names: list, to_global: bool):
    """One ``convert(name, value)`` applying each of ``names``' conversions (in reverse to load)."""
    steps = [n.to_global for n in names] if to_global else [n.to_local for n in reversed(names)]

    def convert(name, value):
        for step in steps:
            name, value = step(name, value)
        return name, value

    return convert


def _renamed(entries: dict, convert) -> dict:
    """``entries`` (name -> tensor, or name -> dict of tensors) with ``convert(name, value)`` applied."""
    result = {}
    for name, value in entries.items():
        if isinstance(value, dict):
            new_name = convert(name, None)[0]
            result[new_name] = {key: convert(name, item)[1] for key, item in value.items()}
        else:
            new_name, result_value = convert(name, value)
            result[new_name] = result_value
    return result


def fsdp_checkpoint_state(
    model: FSDPTrainModel, optimizer: FSDPOptimizer, with_optimizer: bool = True
) -> dict:
    """``{"model": DTensor state dict, "optimizer": optimizer_state_dict}`` for ``torch.distributed.checkpoint``
    (collective), experts named globally."""
    from mcore_fsdp import optimizer_state_dict

    sharded, names = model.chunks[0], model.names
    state = {"model": sharded.state_dict()}
    if with_optimizer:
        state["optimizer"] = optimizer_state_dict(sharded, optimizer.optimizer)
    if names:
        to_global = _chained(names, to_global=True)
        state["model"] = _renamed(state["model"], to_global)
        if with_optimizer:
            optim = state["optimizer"]
            optim["state"] = _renamed(optim["state"], to_global)
            for group in optim["param_groups"]:
                group["params"] = [to_global(name, None)[0] for name in group["params"]]
    return state


def load_fsdp_checkpoint_state(model: FSDPTrainModel, optimizer: FSDPOptimizer, state: dict) -> None:
    """Load what ``DistributedCheckpointer.load`` filled into ``fsdp_checkpoint_state``'s dict.

    The optimizer's parameter groups take their settings from the checkpoint and their members
    from this model (an expert-parallel rank saved only its own experts' names)."""
    from mcore_fsdp import load_optimizer_state_dict

    sharded, to_local = model.chunks[0], _chained(model.names, to_global=False)
    sharded.load_state_dict(_renamed(state["model"], to_local))
    if "optimizer" in state:
        optim = state["optimizer"]
        optim = {**optim, "state": _renamed(optim["state"], to_local)}
        # a different number of groups is refused by load_optimizer_state_dict
        name_of = {id(param): name for name, param in sharded.named_parameters()}
        members = [[name_of[id(param)] for param in group["params"]] for group in optimizer.param_groups]
        groups = [
            {**saved, "params": params} for saved, params in zip(optim["param_groups"], members, strict=False)
        ]
        load_optimizer_state_dict(sharded, optimizer.optimizer, {**optim, "param_groups": groups})


class FSDPCheckpoint:
    """The ``model`` and ``optimizer`` entries of an ``--fsdp`` checkpoint (``fsdp_checkpoint_state``)."""

    def __init__(self, model: FSDPTrainModel, optimizer: FSDPOptimizer, *, with_optimizer: bool = True):
        self.model, self.optimizer, self.with_optimizer = model, optimizer, with_optimizer

    def state_dict(self) -> dict:
        """``{"model", "optimizer"}``: the DTensor state dicts, experts named globally (collective)."""
        return fsdp_checkpoint_state(self.model, self.optimizer, self.with_optimizer)

    def load_state_dict(self, state) -> None:
        """Load the filled state dicts into the sharded model and the optimizer."""
        load_fsdp_checkpoint_state(self.model, self.optimizer, state)


def fsdp_parameter_count(model: FSDPTrainModel, pp_group: dist.ProcessGroup) -> int:
    """Parameters of the whole model, every stage's and expert-parallel rank's included, whole (collective)."""
    sharded, names = model.chunks[0], model.expert_names
    params = {name for name, _ in sharded.named_parameters()}
    counts = torch.zeros(2, dtype=torch.float64)  # [dense, experts]
    for name, value in sharded.state_dict().items():  # DTensors of the global (per-rank expert) shapes
        if name in params:
            numel = value.numel()
            for converter in model.names:
                numel = converter.whole_numel(name, numel)
            counts[int(names is not None and names.is_expert(name))] += numel
    if names is not None:  # each expert-parallel rank holds other experts
        experts = counts[1:].to(get_group_device(names.ep_group))
        dist.all_reduce(experts, group=names.ep_group)
        counts[1] = experts.item()
    total = counts.sum().reshape(1).to(get_group_device(pp_group))
    dist.all_reduce(total, group=pp_group)  # each stage holds other layers
    return round(total.item())


def fsdp_full_model(model: TrainModel, config: TrainModelConfig, groups: ProcessGroupCollection) -> GPTModel:
    """An unsharded ``GPTModel`` holding the sharded model's gathered weights (collective)."""
    full = model.chunks[0].full_state_dict()
    plain = build_model(config, model.chunks[0].vocab_size, pg_collection=groups)
    plain.load_state_dict(full)
    return plain
