"""Checkpoint and resume of the whole RL state of a ``GRPOLoop``: policy, optimizer (Adam moments
and step), reference policy, position in the training prompts, random-number states, history.

One format for every training backend: the policy's whole tensors by state-dict name (gathered
from the shards with FSDP) and, per parameter name, its whole float32 main value and Adam moments
(gathered from the distributed optimizer's or mcore-fsdp's shards), so a checkpoint saved with
DDP, the distributed optimizer or FSDP, on any number of data-parallel ranks, resumes with any of
them (at the tensor-parallel size it was saved with)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from .grpo_loop import GRPOLoop

STATE_FILE = "rl_state.pt"
"""The file a checkpoint directory holds."""


@experimental_api
class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or of another model; the message names the path."""


def loop_state(loop: GRPOLoop) -> dict[str, Any]:
    """Everything ``restore_loop_state`` needs to continue ``loop`` exactly (collective over the
    data-parallel group with the distributed optimizer or FSDP)."""
    names = {param: name for name, param in loop.policy.named_parameters()}
    optimizer = {names[param]: state for param, state in loop.optimizer.gather_param_states().items()}
    return {
        "iteration": loop.iteration,
        "policy": loop.policy_state_dict(),
        "optimizer": optimizer,
        "optimizer_steps": loop.optimizer.step_count,
        "reference": None if loop.reference is None else loop.reference.state_dict(),
        "prompt_position": loop.prompts.position,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "history": loop.history,
        "baseline": loop.baseline,
    }


def restore_loop_state(loop: GRPOLoop, state: dict[str, Any]) -> None:
    """Put ``state`` (of ``loop_state``) into ``loop`` and refit its engine."""
    loop.policy.load_state_dict(state["policy"])
    params = dict(loop.policy.named_parameters())
    loop.optimizer.scatter_param_states(
        {params[name]: value for name, value in state["optimizer"].items()}, state["optimizer_steps"]
    )
    if (loop.reference is None) != (state["reference"] is None):
        raise CheckpointError(
            "beta: the checkpoint was saved "
            + ("without" if state["reference"] is None else "with")
            + " a reference policy (beta > 0); resume with the same beta"
        )
    if loop.reference is not None:
        loop.reference.load_state_dict(state["reference"])
    loop.iteration, loop.prompts.position = state["iteration"], state["prompt_position"]
    loop.history, loop.baseline = list(state["history"]), state["baseline"]
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    loop.refit_engine()


@experimental_api
def save_checkpoint(loop: GRPOLoop, directory: str | os.PathLike) -> Path:
    """Write ``loop``'s whole RL state to ``directory/rl_state.pt`` (atomically: a failed save
    leaves the previous checkpoint); returns the file's path. Collective over the process
    group: every rank gathers the state (a distributed optimizer's shards), rank 0 writes it,
    the others wait for the file."""
    path = Path(directory)
    state = loop_state(loop)
    target, partial = path / STATE_FILE, path / (STATE_FILE + ".partial")
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, partial)
        os.replace(partial, target)
    dist.barrier()
    return target


@experimental_api
def load_checkpoint(loop: GRPOLoop, directory: str | os.PathLike) -> int:
    """Resume ``loop`` from ``directory`` (of ``save_checkpoint``); returns its iteration.

    Raises ``CheckpointError`` naming the path when there is no checkpoint, it cannot be read,
    or its policy does not fit ``loop``'s."""
    target = Path(directory) / STATE_FILE
    if not target.is_file():
        raise CheckpointError(f"{target}: no RL checkpoint there (save_checkpoint writes {STATE_FILE})")
    try:
        state = torch.load(target, weights_only=False)
    except Exception as error:  # a truncated or foreign file
        raise CheckpointError(f"{target}: cannot be read: {type(error).__name__}: {error}") from None
    try:
        restore_loop_state(loop, state)
    except (RuntimeError, KeyError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{target}: does not fit this policy: {error}") from None
    return loop.iteration
