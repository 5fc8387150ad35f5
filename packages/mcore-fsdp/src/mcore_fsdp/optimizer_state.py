"""Optimizer state dicts of a sharded model, keyed by parameter name: per-parameter state shaped
like the main-parameter shards becomes DTensors laid out like the model's state dict, so
``torch.distributed.checkpoint`` can reload it on another topology or strategy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mcore_fsdp.errors import CheckpointMismatchError
from mcore_fsdp.flat_param_group import FlatParamGroup, ParamSlot
from mcore_fsdp.state_dict import model_groups, named_slots, names_by_slot, to_dtensor


def _main_params_by_name(model: nn.Module) -> dict[str, tuple[FlatParamGroup, ParamSlot, nn.Parameter]]:
    """Each main parameter of ``model`` under its first ``state_dict`` name, with group and slot."""
    named = named_slots(model)
    names = names_by_slot(named)
    return {
        names[id(slot)][0]: (group, slot, param)
        for group in model_groups(named)
        for slot, param in zip(group.slots, group.main_params, strict=True)
        if id(slot) in names
    }


def _locate(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple]:
    """``_main_params_by_name``, after refusing an optimizer that holds foreign tensors."""
    by_name = _main_params_by_name(model)
    known = {id(param) for _, _, param in by_name.values()}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            if id(param) not in known:
                raise CheckpointMismatchError(
                    "the optimizer holds a tensor that is not a main parameter of the model; build it "
                    "on model.parameters()"
                )
    return by_name


def _is_sharded(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape == param.shape


def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create missing per-parameter state with a step that changes nothing (zero gradients, lr 0)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if all(param in optimizer.state for param in params):
        return
    saved = [(group, group["lr"]) for group in optimizer.param_groups]
    grads = {param: param.grad for param in params}
    with torch.no_grad():
        for param in params:
            param.grad = torch.zeros_like(param)
        for group, _ in saved:
            group["lr"] = 0.0
        optimizer.step()
        for group, lr in saved:
            group["lr"] = lr
        for param, grad in grads.items():
            param.grad = grad


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state of ``optimizer`` (built on ``model.parameters()``) keyed by parameter name.

    ``{"state": {name: {key: DTensor | tensor}}, "param_groups": [{..., "params": [name, ...]}]}``.
    Missing state is created first (a step with lr 0), so the result also serves as the template
    ``torch.distributed.checkpoint.load`` fills. A collective: every rank calls it.
    """
    by_name = _locate(model, optimizer)
    name_of = {id(param): name for name, (_, _, param) in by_name.items()}
    _ensure_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for group in model_groups(named_slots(model)):
        first = group.main_params[0] if group.main_params else None
        sharded_keys = sorted(
            key for key, value in optimizer.state.get(first, {}).items() if _is_sharded(value, first)
        )
        for key in sharded_keys:
            owned = torch.zeros_like(group.main)
            for slot, param in zip(group.slots, group.main_params, strict=True):
                if key in optimizer.state.get(param, {}):
                    owned[group.main_range(slot)].copy_(optimizer.state[param][key])
            full = group.gather_full(owned)
            for slot, param in zip(group.slots, group.main_params, strict=True):
                if id(param) in name_of:
                    value = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    state.setdefault(name_of[id(param)], {})[key] = to_dtensor(group, slot, value)
        for param in group.main_params:
            for key, value in optimizer.state.get(param, {}).items():
                if key not in sharded_keys and id(param) in name_of:
                    state.setdefault(name_of[id(param)], {})[key] = (
                        value.clone() if torch.is_tensor(value) else value
                    )
    param_groups = [
        {
            **{k: v for k, v in param_group.items() if k != "params"},
            "params": [name_of[id(p)] for p in param_group["params"]],
        }
        for param_group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load a state dict made by ``optimizer_state_dict`` on any topology or strategy.

    Names, group layout and global shapes are checked before any communication; a mismatch raises
    ``CheckpointMismatchError``.
    """
    named = _locate(model, optimizer)
    name_of = {id(param): name for name, (_, _, param) in named.items()}
    saved_groups = state_dict.get("param_groups", [])
    current = [[name_of[id(param)] for param in group["params"]] for group in optimizer.param_groups]
    if [group.get("params") for group in saved_groups] != current:
        raise CheckpointMismatchError(
            f"optimizer state dict parameter groups (sizes {[len(g.get('params', [])) for g in saved_groups]}) "
            f"do not match the optimizer's (sizes {[len(names) for names in current]}) or name other parameters"
        )
    saved_state = state_dict.get("state", {})
    for name, entries in saved_state.items():
        if name not in named:
            raise CheckpointMismatchError(f"optimizer state for unknown parameter {name!r}")
        shape = tuple(named[name][1].shape)
        for key, value in entries.items():
            if isinstance(value, DTensor) and tuple(value.shape) != shape:
                raise CheckpointMismatchError(
                    f"optimizer state {name}.{key}: checkpoint {tuple(value.shape)} vs model {shape}"
                )

    index_of = {
        id(param): index for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    loaded: dict[int, dict[str, Any]] = {}
    for name in sorted(saved_state):
        group, slot, param = named[name]
        entries = {}
        for key in sorted(saved_state[name]):
            value = saved_state[name][key]
            if isinstance(value, DTensor):
                full = value.full_tensor().reshape(-1)
                value = full[slot.local_start : slot.local_stop].to(group.main_device).clone()
            entries[key] = value
        loaded[index_of[id(param)]] = entries
    groups = [
        {**saved, "params": [index_of[id(param)] for param in group["params"]]}
        for saved, group in zip(saved_groups, optimizer.param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": loaded, "param_groups": groups})
