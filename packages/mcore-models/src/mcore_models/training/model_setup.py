"""Building this rank's model: its pipeline chunks of a ``GPTModel`` (a ``HybridModel`` with
``hybrid_layer_pattern``, see ``build_model``), wrapped for data parallelism.

All chunks of a rank share one ``DistributedDataParallel`` (over a ``ModuleList``), so one optimizer
and one checkpoint state cover them. Parameters are named globally for checkpoints by
``global_parameter_name``: a chunk's ``decoder.layers.<i>`` becomes the layer's global index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import (
    ConfigError,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ProcessGroupCollection,
    get_device,
    model_parallel_manual_seed,
)

from ..models.gpt.model import GPTModel
from ..models.hybrid.model import HybridModel
from .config import TrainModelConfig

_LAYER = re.compile(r"^(\d+)\.decoder\.layers\.(\d+)\.(.*)$")
_CHUNK = re.compile(r"^(\d+)\.(.*)$")


@experimental_api
@dataclass
class TrainModel:
    """This rank's chunks (``GPTModel`` each), their container and its data-parallel wrapper."""

    chunks: list[GPTModel]
    container: torch.nn.ModuleList
    ddp: DistributedDataParallel

    @property
    def schedule_model(self) -> torch.nn.Module | list[torch.nn.Module]:
        """What the pipeline schedule runs: the DDP wrapper for one chunk (so ``no_sync`` applies),
        else the list of chunks (the caller keeps gradient reduction for the step's end)."""
        return self.ddp if len(self.chunks) == 1 else list(self.chunks)

    def train(self, mode: bool = True) -> None:
        self.container.train(mode)

    def global_parameter_name(self, local_name: str) -> str:
        """``<chunk>.decoder.layers.<i>.rest`` -> ``decoder.layers.<global i>.rest``; else drop the chunk."""
        match = _LAYER.match(local_name)
        if match:
            chunk, index, rest = int(match[1]), int(match[2]), match[3]
            number = self.chunks[chunk].decoder.layers[index].layer_number
            return f"decoder.layers.{number - 1}.{rest}"
        return _CHUNK.match(local_name)[2]

    def checkpoint_state(self, optimizer, tp_group, *, with_optimizer: bool = True, loading=None):
        """The ``Stateful`` checkpoint component of this model and ``optimizer`` (a
        ``ParamStatesOptimizer``): parameters named globally, TP shards by their global shape (see
        ``checkpointing.ParamStatesCheckpoint``; ``loading``: the checkpointer to load from)."""
        from .checkpointing import ParamStatesCheckpoint

        return ParamStatesCheckpoint(
            self, optimizer, tp_group, with_optimizer=with_optimizer, loading=loading
        )


@experimental_api
def build_model(config: TrainModelConfig, vocab_size: int, **kwargs) -> GPTModel:
    """The model ``config`` describes: a ``HybridModel`` of its ``hybrid_layer_pattern`` and
    ``mamba`` fields, else a ``GPTModel``; ``kwargs`` go to the model's constructor."""
    if config.hybrid_layer_pattern is None:
        return GPTModel(config, vocab_size, **kwargs)
    return HybridModel(config, vocab_size, config.hybrid_layer_pattern, config.mamba, **kwargs)


@experimental_api
def build_train_model(
    config: TrainModelConfig,
    vocab_size: int,
    groups: ProcessGroupCollection,
    ddp_config: DistributedDataParallelConfig,
    seed: int,
    extra_modules: Mapping[str, torch.nn.Module] | None = None,
) -> TrainModel:
    """The chunks of this pipeline stage (``virtual_pipeline_model_parallel_size`` of them, else one).

    Weights come from ``seed`` and the stage (TP ranks draw their own shards of one master weight).
    ``extra_modules`` (e.g. distillation's projections) become submodules of the chunk with the
    output layer, by name, before the data-parallel wrapper: they train and are checkpointed with it.
    """
    pp, stage = dist.get_world_size(groups.pp), dist.get_rank(groups.pp)
    tp_rank = dist.get_rank(groups.tp)
    count = config.virtual_pipeline_model_parallel_size or 1
    device = get_device()
    chunks = []
    for chunk in range(count):
        model_parallel_manual_seed(seed + 100 * (chunk * pp + stage), tp_rank)
        chunks.append(
            build_model(
                config,
                vocab_size,
                pre_process=stage == 0 and chunk == 0,
                post_process=stage == pp - 1 and chunk == count - 1,
                pg_collection=groups,
                vp_stage=chunk if count > 1 else None,
            ).to(device)  # initialized on the CPU: the same weights on every device
        )
    for name, module in (extra_modules or {}).items():
        chunks[-1].add_module(name, module.to(device))
    container = torch.nn.ModuleList(chunks)
    _check_overlap(container, ddp_config, groups)
    # context-parallel ranks hold replicas of the weights too: their gradients are reduced with DP's
    cp_size = dist.get_world_size(groups.cp) if groups.cp is not None else 1
    # experts differ between expert-parallel ranks (and are split with expert tensor parallelism):
    # theirs are reduced over the ranks holding the same
    ep_size = dist.get_world_size(groups.ep) if groups.ep is not None else 1
    experts_apart = ep_size > 1 or config.expert_tensor_parallel_size is not None
    ddp = DistributedDataParallel(
        container,
        ddp_config,
        groups.dp_cp if cp_size > 1 else groups.dp,
        expert_dp_group=groups.expert_dp if experts_apart else None,
    )
    return TrainModel(chunks, container, ddp)


def _check_overlap(
    container: torch.nn.Module, ddp_config: DistributedDataParallelConfig, groups: ProcessGroupCollection
) -> None:
    """Gradients summed over TP ranks after backward cannot be in flight already."""
    partial = any(getattr(p, "sequence_parallel", False) for p in container.parameters())
    if ddp_config.overlap_grad_reduce and partial and dist.get_world_size(groups.tp) > 1:
        raise ConfigError(
            ["overlap_grad_reduce", "sequence_parallel"],
            "overlapped gradient reduction cannot be combined with parameters whose gradients are summed "
            "over tensor-parallel ranks after backward (sequence parallelism, qk-norm)",
        )
