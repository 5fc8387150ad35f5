"""Training checkpoints: model and optimizer state named globally, so any TP/PP/DP layout (and
either optimizer) can load what another saved, through mcore-parallel's ``DistributedCheckpointer``.

Keys: ``model.<global parameter name>`` (a tensor-parallel shard made of slices of several blocks
of the global tensor, such as a gated fc1 or a Mamba projection, one key per block: see
``_add_sharded``; MoE experts by their global index, see ``_global_names``,
so any expert-parallel size loads them) and ``model.<global buffer name>`` of the persistent
buffers (routers' expert biases, replicated), ``optimizer.<global parameter name>.<main|exp_avg|exp_avg_sq>``
and ``optimizer.step``. Tensor-parallel shards are described with their global shape
(``sharded_tensor``), so loading reshards them. ``history`` (JSON text, saved with the tensors,
so an asynchronous save needs nothing written after it) keeps the loss curve so far for the report
of a resumed run. With ``--fsdp`` the keys are ``model.<name>`` and ``optimizer.state.<name>...``
of mcore-fsdp's DTensor state dicts instead. Either way ``rng.*`` holds each rank's random-number
states (unless ``no_save_rng``), restored only under the same layout (see ``random_states``).

Each part is a ``Stateful`` component (``stateful``): the model with its optimizer
(``TrainModel.checkpoint_state``: ``ParamStatesCheckpoint`` here, ``FSDPCheckpoint`` with ``--fsdp``),
``LossHistory`` and ``RandomStates`` (``checkpoint_components``); saving merges their entries,
loading fills the merged dict in place and hands it back to each.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_api import experimental_api, internal_api
from mcore_parallel import DistributedCheckpointer, ProcessGroupCollection, checkpoint_dir, sharded_tensor

from ..hf.sharding import shard_full_tensor
from ..transformer.moe.expert_names import (
    expert_parallel_parameters,
    expert_tensor_parallel_parameters,
    global_expert_name,
)
from ..transformer.process_groups import resolve_process_groups
from .checkpoint_components import LossHistory, RandomStates
from .expert_tp_checkpoint import SliceBack, copy_slices_back, whole_expert_tensor
from .model_setup import TrainModel
from .optimizer_protocol import ParamStatesOptimizer, TrainOptimizer
from .stateful import Stateful, checkpoint_entries, load_entries


def _partition_dim(param: torch.Tensor) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _add_sharded(
    state: dict, key: str, tensor: torch.Tensor, param: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> None:
    """``state[key]``: ``tensor`` described as its TP shard of the global tensor.

    A shard made of slices of several blocks of the global tensor (see ``_shard_blocks``) is
    stored as one entry per block, ``key.<block>``, each a contiguous slice of its global block."""
    dim = _partition_dim(param)
    blocks = _shard_blocks(tensor, param, tp_group)
    if blocks is None:
        state[key] = sharded_tensor(tensor, tp_group, dim)
        return
    for name, block in blocks.items():
        state[f"{key}.{name}"] = sharded_tensor(block, tp_group, dim)


def _shard_blocks(
    tensor: torch.Tensor, param: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor] | None:
    """The blocks of a TP shard that is not a contiguous slice of the global tensor, by name: a
    gated MLP's fc1 shard ``[its gate rows; its up rows]`` as ``gate`` and ``up``; a Mamba
    projection tagged ``partition_blocks`` (see ``ssm.blockwise_shard``) as ``block0``,
    ``block1``, ...; ``None`` for any other tensor."""
    if _partition_dim(param) is None:
        return None
    if getattr(param, "gated_halves", False):
        gate, up = tensor.chunk(2, dim=param.partition_dim)
        return {"gate": gate, "up": up}
    if not hasattr(param, "partition_blocks"):
        return None
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    blocks = tensor.split([size // tp for size in param.partition_blocks], dim=0)
    return {f"block{index}": block for index, block in enumerate(blocks)}


def _global_names(model: TrainModel) -> list[tuple[str, torch.nn.Parameter, tuple | None]]:
    """``(global name, parameter, expert sharding)`` for every parameter of ``model``.

    An MoE layer's experts are named by their global expert index: ``local_experts.<j>`` becomes
    ``local_experts.<first + j>``; tensors stacked by expert (``GroupedExperts``) get the sharding
    ``(ep_group, 0)``, so an expert-parallel rank's experts are its slice of the global stack."""
    experts = expert_parallel_parameters(model.container)
    named = []
    for local_name, param in model.container.named_parameters():
        name, sharding = model.global_parameter_name(local_name), None
        layer = experts.get(param)
        if layer is not None:
            renamed = global_expert_name(name, layer.local_expert_offset)
            name, sharding = (name, (layer.ep_group, 0)) if renamed is None else (renamed, None)
        named.append((name, param, sharding))
    return named


def _add(state: dict, key: str, tensor: torch.Tensor, param, sharding, tp_group) -> None:
    if sharding is None:
        _add_sharded(state, key, tensor, param, tp_group)
    else:
        state[key] = sharded_tensor(tensor, *sharding)


def _persistent_buffers(module: torch.nn.Module, name_of=lambda name: name) -> dict[str, torch.Tensor]:
    """``model.<name_of(name)>`` of every persistent buffer of ``module`` (a router's expert biases),
    the buffers themselves; parameters (tied ones too) left out."""
    return {
        f"model.{name_of(name)}": tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if not isinstance(tensor, torch.nn.Parameter)
    }


@internal_api
def training_state_dict(
    model: TrainModel,
    optimizer,
    tp_group: dist.ProcessGroup,
    with_optimizer: bool = True,
    param_states: dict | None = None,
    saved_keys: set[str] | None = None,
    slice_back: list[SliceBack] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint. Its tensors are views of the parameters and of
    ``param_states`` (default ``optimizer.gather_param_states()``), and the persistent buffers
    themselves, so loading into it fills them. With ``saved_keys`` (the checkpoint's, to load it),
    buffers it lacks are left out: a checkpoint saved before buffers were saved keeps them fresh.
    Experts split over expert-tensor-parallel ranks are gathered whole (collective) instead: a load
    fills the whole tensors, and ``copy_slices_back(slice_back)`` then puts each rank's slices in place."""
    state: dict[str, torch.Tensor] = {}
    named = _global_names(model)
    split = expert_tensor_parallel_parameters(model.container)

    def local(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        layer = split.get(param)
        return (
            tensor if layer is None else whole_expert_tensor(tensor, param, layer.expert_tp_group, slice_back)
        )

    for g, p, sharding in named:
        _add(state, f"model.{g}", local(p.detach(), p), p, sharding, tp_group)
    for key, buffer in _persistent_buffers(model.container, model.global_parameter_name).items():
        if saved_keys is None or key in saved_keys:
            state[key] = buffer
    if with_optimizer:
        states = param_states if param_states is not None else optimizer.gather_param_states()
        for g, p, sharding in named:
            for key, value in states[p].items():
                _add(state, f"optimizer.{g}.{key}", local(value, p), p, sharding, tp_group)
        state["optimizer.step"] = torch.tensor(optimizer.step_count)
    return state


def inference_model_state_dict(
    model: torch.nn.Module, saved_keys: set[str], tp_group: dist.ProcessGroup | None = None
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """The ``model.*`` entries of a checkpoint (whose keys are ``saved_keys``) for a model without
    pipeline or expert parallelism (every layer in it), at the tensor-parallel size of ``tp_group``
    (``None``: unsharded), and its persistent buffers: views of its parameters (TP shards described
    by their global shape), so loading a checkpoint saved at any layout fills them.

    A gated MLP's fc1 (a Mamba projection) is read as its two halves (its blocks) where the
    checkpoint has them apart (saved without ``--fsdp``), else whole: then, at TP > 1, into a
    full-size buffer whose shard ``finish()`` (to call after loading) copies into the parameter."""
    state: dict[str, torch.Tensor] = _persistent_buffers(model)
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its full tensor)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_group = tp_group if tp > 1 else None  # plain tensors for a whole model
    for name, param in model.named_parameters():
        key = f"model.{name}"
        blocks = _shard_blocks(param, param, tp_group)
        if blocks is None or f"{key}.{next(iter(blocks))}" in saved_keys:
            _add_sharded(state, key, param.detach(), param, tp_group)
        elif tp == 1:
            state[key] = param.detach()
        else:
            shape = list(param.shape)
            shape[param.partition_dim] *= tp
            whole.append((param, param.new_empty(shape)))
            state[key] = whole[-1][1]

    def finish() -> None:
        with torch.no_grad():
            for param, full in whole:
                param.copy_(shard_full_tensor(param, full, dist.get_rank(tp_group), tp))

    return state, finish


class ParamStatesCheckpoint:
    """The model and ``ParamStatesOptimizer`` entries of a checkpoint (``training_state_dict``'s keys).

    Given ``loading`` (the checkpointer to load from), ``state_dict()`` gives the views to fill:
    buffers the checkpoint lacks left out, whole expert tensors cut back by ``load_state_dict``,
    which also hands the loaded optimizer states to the optimizer (fresh ones without them)."""

    def __init__(
        self,
        model: TrainModel,
        optimizer: ParamStatesOptimizer,
        tp_group: dist.ProcessGroup,
        *,
        with_optimizer: bool = True,
        loading: DistributedCheckpointer | None = None,
    ):
        self.model, self.optimizer, self.tp_group = model, optimizer, tp_group
        self.with_optimizer, self.loading = with_optimizer, loading
        self._states: dict | None = None
        self._slice_back: list[SliceBack] = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's entries (collective: whole expert tensors are gathered)."""
        if self.loading is None:
            return training_state_dict(self.model, self.optimizer, self.tp_group, self.with_optimizer)
        self._states = self.optimizer.gather_param_states() if self.with_optimizer else None
        saved, self._slice_back = self.loading.saved_keys(), []
        return training_state_dict(
            self.model,
            self.optimizer,
            self.tp_group,
            self.with_optimizer,
            self._states,
            saved,
            self._slice_back,
        )

    def load_state_dict(self, state) -> None:
        """Put the loaded values in place (the model's already are: its entries are views)."""
        copy_slices_back(self._slice_back)
        if self.with_optimizer:  # ``self._states`` now holds the loaded values
            self.optimizer.scatter_param_states(self._states, int(state["optimizer.step"]))
            return
        fresh = {  # fresh optimizer state on the loaded weights
            p: {
                "main": p.detach().float(),
                "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
            }
            for p in self.model.container.parameters()
        }
        self.optimizer.scatter_param_states(fresh, 0)


@experimental_api
def save_training_checkpoint(
    checkpointer: DistributedCheckpointer,
    model: TrainModel,
    optimizer: TrainOptimizer,
    tp_group: dist.ProcessGroup,
    iteration: int,
    history: dict,
    groups: ProcessGroupCollection | None = None,
    write_files: Callable[[Path], None] | None = None,
) -> Path:
    """Save the checkpoint of ``iteration`` with the loss ``history`` (collective); returns its directory.

    ``write_files(directory)`` (rank 0) writes files beside the tensors, published with them: the
    loop's writes the model config, tokenizer and run configs (``checkpoints.metadata``).

    Each rank's random-number states go with it unless ``checkpointer.config.no_save_rng``, recorded
    with the layout of ``groups`` (default: the global groups of ``initialize_model_parallel``).
    With ``async_save`` the tensors are staged (copied) here and written in the background:
    ``checkpointer.wait()`` (or the next save) completes it and marks it latest."""
    with_optimizer = not checkpointer.config.no_save_optim
    components: list[Stateful] = [
        model.checkpoint_state(optimizer, tp_group, with_optimizer=with_optimizer),
        LossHistory(history),
    ]
    if not checkpointer.config.no_save_rng:
        components.append(RandomStates(resolve_process_groups(groups)))
    return save_components(checkpointer, components, iteration, write_files)


@internal_api
def save_components(
    checkpointer: DistributedCheckpointer,
    components: list[Stateful],
    iteration: int,
    write_files: Callable[[Path], None] | None = None,
) -> Path:
    """Save the merged entries of ``components`` as the checkpoint of ``iteration`` (collective)."""
    state = checkpoint_entries(components)
    if checkpointer.config.async_save:  # torch's stager cannot copy views of DDP's flat buffers
        state = _cloned(state)
    checkpointer.save(state, iteration, write_files=write_files)
    return checkpoint_dir(checkpointer.config.save, iteration)


def _cloned(state):
    """``state`` with every tensor replaced by a copy (nested dicts followed)."""
    if isinstance(state, dict):
        return {key: _cloned(value) for key, value in state.items()}
    return state.detach().clone() if torch.is_tensor(state) else state


@experimental_api
def load_training_checkpoint(
    checkpointer: DistributedCheckpointer,
    model: TrainModel,
    optimizer: TrainOptimizer,
    tp_group: dist.ProcessGroup,
    groups: ProcessGroupCollection | None = None,
) -> tuple[int, dict]:
    """Load the latest checkpoint of ``checkpointer.config.load`` into model and optimizer (collective).

    The random-number states are restored too, unless ``checkpointer.config.no_load_rng``, the
    checkpoint has none, or it was saved under a layout other than that of ``groups`` (default: the
    global groups of ``initialize_model_parallel``; then rank 0 warns): in those cases the current
    states stay. Returns the iteration loaded and the saved history (empty when there is none).
    """
    with_optimizer = not checkpointer.config.no_load_optim
    rng = RandomStates.for_load(checkpointer, resolve_process_groups(groups))
    model_state = model.checkpoint_state(
        optimizer, tp_group, with_optimizer=with_optimizer, loading=checkpointer
    )
    history = LossHistory(loading=True)
    iteration = load_components(checkpointer, [model_state, history, rng])
    return iteration, history.history


@internal_api
def load_components(checkpointer: DistributedCheckpointer, components: list[Stateful]) -> int:
    """Load the latest checkpoint into ``components`` (collective); returns its iteration."""
    state = checkpoint_entries(components)
    iteration = checkpointer.load(state)
    load_entries(components, state)
    return iteration
