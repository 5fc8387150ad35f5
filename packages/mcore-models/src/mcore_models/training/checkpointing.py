"""Training checkpoints: model and optimizer state named globally, so any TP/PP/DP layout (and
either optimizer) can load what another saved, through mcore-parallel's ``DistributedCheckpointer``.

Keys: ``model.<global parameter name>``, ``optimizer.<global parameter name>.<main|exp_avg|exp_avg_sq>``
and ``optimizer.step``. Tensor-parallel shards are described with their global shape
(``sharded_tensor``), so loading reshards them. ``history.json`` beside the tensors keeps the loss
curve so far for the report of a resumed run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_parallel import DistributedCheckpointer, checkpoint_dir, sharded_tensor

from .model_setup import TrainModel

HISTORY_FILE = "history.json"


def _partition_dim(param: torch.Tensor) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def training_state_dict(
    model: TrainModel, optimizer, tp_group: dist.ProcessGroup, with_optimizer: bool = True
) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint; loading into it fills the model (and optimizer views)."""
    named = [(model.global_parameter_name(n), p) for n, p in model.container.named_parameters()]
    state = {f"model.{g}": sharded_tensor(p.detach(), tp_group, _partition_dim(p)) for g, p in named}
    if with_optimizer:
        states = optimizer.param_states()
        for g, p in named:
            for key, value in states[p].items():
                state[f"optimizer.{g}.{key}"] = sharded_tensor(value, tp_group, _partition_dim(p))
        state["optimizer.step"] = torch.tensor(optimizer.step_count)
    return state


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def save_training_checkpoint(
    checkpointer: DistributedCheckpointer,
    model: TrainModel,
    optimizer,
    tp_group: dist.ProcessGroup,
    iteration: int,
    history: dict,
) -> Path:
    """Save the checkpoint of ``iteration`` (collective); rank 0 adds ``history.json``."""
    state = training_state_dict(model, optimizer, tp_group, not checkpointer.config.no_save_optim)
    checkpointer.save(state, iteration)
    checkpointer.wait()
    directory = checkpoint_dir(checkpointer.config.save, iteration)
    if dist.get_rank() == 0:
        (directory / HISTORY_FILE).write_text(json.dumps(history))
    return directory


def load_training_checkpoint(
    checkpointer: DistributedCheckpointer, model: TrainModel, optimizer, tp_group: dist.ProcessGroup
) -> tuple[int, dict]:
    """Load the latest checkpoint of ``checkpointer.config.load`` into model and optimizer (collective).

    Returns the iteration loaded and the saved history (empty when there is none).
    """
    with_optimizer = not checkpointer.config.no_load_optim
    state = training_state_dict(model, optimizer, tp_group, with_optimizer)
    iteration = checkpointer.load(state)
    if with_optimizer:
        states = {}
        for name, param in model.container.named_parameters():
            g = model.global_parameter_name(name)
            states[param] = {
                key: _local(state[f"optimizer.{g}.{key}"]) for key in ("main", "exp_avg", "exp_avg_sq")
            }
        optimizer.load_param_states(states, int(state["optimizer.step"]))
    else:  # fresh optimizer state on the loaded weights
        fresh = {
            p: {"main": p.detach().float(), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
            for p in model.container.parameters()
        }
        optimizer.load_param_states(fresh, 0)
    history_file = checkpoint_dir(checkpointer.config.load, iteration) / HISTORY_FILE
    history = json.loads(history_file.read_text()) if history_file.exists() else {}
    return iteration, history
