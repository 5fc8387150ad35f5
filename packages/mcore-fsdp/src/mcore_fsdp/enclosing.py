"""A forgotten root call: ``fully_shard(layer)`` for every layer but never ``fully_shard(model)``
leaves each layer a root of its own, and the model's other parameters (embedding, head) would
train with rank-local gradients, silently diverging. A root checks at its first forward that no
module it runs inside holds trainable parameters that no ``fully_shard`` call manages."""

from __future__ import annotations

import sys

from torch import nn

from mcore_fsdp import ownership
from mcore_fsdp.errors import FSDPConfigError

_CALL_CODE = nn.Module._call_impl.__code__


def _enclosing_modules() -> list[nn.Module]:
    """Modules whose forward is running on this thread, innermost first, read off the call stack.

    Best effort: a forward that does not go through ``nn.Module._call_impl`` (e.g. compiled) is
    not seen.
    """
    found, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                found.append(module)
        frame = frame.f_back
    return found


def _unmanaged_trainable(module: nn.Module, prefix: str = "") -> list[str]:
    """Names of trainable parameters under ``module`` outside every sharded module."""
    if ownership.unit_of_module(module) is not None:
        return []
    names = [
        prefix + name
        for name, param in module._parameters.items()
        if param is not None and param.requires_grad and ownership.owner(param) is None
    ]
    for child_name, child in module._modules.items():
        if child is not None:
            names += _unmanaged_trainable(child, f"{prefix}{child_name}.")
    return names


def check_no_unmanaged_enclosing(root: nn.Module) -> None:
    """Raise ``FSDPConfigError`` if ``root``'s forward runs inside a module with trainable
    parameters that no ``fully_shard`` call manages; called before any collective."""
    for module in _enclosing_modules():
        if module is root or ownership.unit_of_module(module) is not None:
            continue
        unmanaged = _unmanaged_trainable(module)
        if unmanaged:
            raise FSDPConfigError(
                f"fully_shard made this {ownership.unit_of_module(root).module_class.__name__} a root, "
                f"but it runs inside a "
                f"{type(module).__name__} whose parameters {unmanaged[:3]} no fully_shard call manages: "
                "their gradients would not be synchronized across ranks. Call fully_shard on the model's "
                "root module too, after the calls on its layers"
            )
