"""``Stateful``: the one way a training component puts itself into a checkpoint.

A component's ``state_dict()`` gives its checkpoint entries (flat keys; tensors may be views of its
own tensors, so loading into them fills the component), and ``load_state_dict(state)`` takes them
back after ``DistributedCheckpointer.load`` has filled the merged dict of all components in place.
``checkpoint_entries`` merges the components' entries and refuses anything that is not ``Stateful``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """A component with checkpoint state: ``state_dict()`` out, ``load_state_dict(state)`` in."""

    def state_dict(self) -> Mapping[str, Any]:
        """The component's checkpoint entries."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the entries back from ``state`` (which may hold other components' entries too)."""
        ...


def require_stateful(components: Iterable[object]) -> list[Stateful]:
    """``components`` as a list, each checked to be ``Stateful``.

    Raises:
        TypeError: naming the first component without ``state_dict`` / ``load_state_dict``.
    """
    checked = list(components)
    for component in checked:
        if not isinstance(component, Stateful):
            raise TypeError(
                f"{type(component).__name__} is not Stateful: a checkpoint component needs "
                "state_dict() and load_state_dict(state)"
            )
    return checked


def checkpoint_entries(components: Iterable[Stateful]) -> dict[str, Any]:
    """The merged entries of ``components``, in their order (each must be ``Stateful``).

    Raises:
        TypeError: a component is not ``Stateful``.
        ValueError: two components give the same key.
    """
    entries: dict[str, Any] = {}
    for component in require_stateful(components):
        state = component.state_dict()
        clash = entries.keys() & state.keys()
        if clash:
            raise ValueError(f"{type(component).__name__} repeats checkpoint keys {sorted(clash)[:3]}")
        entries.update(state)
    return entries


def load_entries(components: Iterable[Stateful], entries: Mapping[str, Any]) -> None:
    """Hand the loaded ``entries`` to every component, in order."""
    for component in require_stateful(components):
        component.load_state_dict(entries)
