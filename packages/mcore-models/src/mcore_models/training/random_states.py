"""The random-number states in a training checkpoint: each rank's own, restored only under the layout
they were saved with.

Saved per rank, as Megatron-Core does: Python's ``random``, NumPy's global generator, the torch CPU
generator, the device generator (CUDA only; on CPU it is the CPU generator) and every stream of
mcore-parallel's RNG tracker (``model-parallel-rng``: dropout inside tensor-parallel regions).

Keys: ``rng.layout``, the same JSON on every rank (``{"tp", "cp", "pp", "dp", "device"}``: the
group sizes and the device type the states were saved under), and per rank
``rng.tp<t>.cp<c>.pp<p>.dp<d>.<python|numpy|torch|device|tracker.<stream>>``, named by the rank's
coordinates in the parallel grid (not its global rank, so the rank order does not matter). Each rank
writes only its own entries (torch states as ``uint8`` tensors, Python's and NumPy's as JSON text)
and reads back only its own.

A rank's stream depends on its place in the layout (TP ranks draw differently inside tensor-parallel
regions, and TP peers must agree outside them), so the states map onto ranks only when the layout is
the same. Under another layout loading warns (rank 0, once) and keeps this run's freshly seeded
states, as ``--no-load-rng`` does; a checkpoint saved without states (``--no-save-rng``, or from
before they were saved) keeps them silently.
"""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist
from mcore_parallel import (
    DistributedCheckpointer,
    ProcessGroupCollection,
    get_device_rng_state,
    get_rng_tracker,
    set_device_rng_state,
)

RNG_LAYOUT_KEY = "rng.layout"
_TRACKER = "tracker."


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)


def _layout_and_prefix(groups: ProcessGroupCollection) -> tuple[dict, str]:
    """This run's layout record and this rank's key prefix."""
    coordinates = {name: _size_and_rank(getattr(groups, name)) for name in ("tp", "cp", "pp", "dp")}
    layout = {name: size for name, (size, _) in coordinates.items()}
    layout["device"] = get_rng_tracker().device.type
    prefix = "rng." + ".".join(f"{name}{rank}" for name, (_, rank) in coordinates.items())
    return layout, prefix


def _describe(layout: dict) -> str:
    return " ".join(f"{name.upper()}={layout[name]}" for name in ("tp", "cp", "pp", "dp")) + (
        f" on {layout['device']}"
    )


def rng_checkpoint_state(groups: ProcessGroupCollection) -> dict[str, torch.Tensor | str]:
    """This rank's random-number states as checkpoint entries, with the layout record."""
    layout, prefix = _layout_and_prefix(groups)
    tracker = get_rng_tracker()
    name, key, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, torch.Tensor | str] = {
        RNG_LAYOUT_KEY: json.dumps(layout),
        f"{prefix}.python": json.dumps(random.getstate()),
        f"{prefix}.numpy": json.dumps([name, key.tolist(), int(position), int(has_gauss), float(gauss)]),
        f"{prefix}.torch": torch.get_rng_state(),
    }
    if tracker.device.type != "cpu":
        state[f"{prefix}.device"] = get_device_rng_state(tracker.device)
    for stream, value in tracker.get_states().items():
        state[f"{prefix}.{_TRACKER}{stream}"] = value
    return state


def rng_entries_to_load(
    checkpointer: DistributedCheckpointer, groups: ProcessGroupCollection
) -> dict[str, torch.Tensor | str]:
    """Placeholders for this rank's states in the latest checkpoint, to load with the rest (collective).

    Empty (the fresh states stay) with ``no_load_rng``, when the checkpoint has no states, or when
    it was saved under another layout (then rank 0 warns).
    """
    if checkpointer.config.no_load_rng:
        return {}
    saved = checkpointer.saved_keys()
    if RNG_LAYOUT_KEY not in saved:
        return {}
    record = {RNG_LAYOUT_KEY: ""}
    checkpointer.load(record)
    saved_layout = json.loads(record[RNG_LAYOUT_KEY])
    layout, prefix = _layout_and_prefix(groups)
    if saved_layout != layout:
        if dist.get_rank() == 0:
            warnings.warn(
                f"the checkpoint's random-number states were saved under {_describe(saved_layout)}, "
                f"this run is {_describe(layout)}: they do not map onto its ranks, so the freshly "
                "seeded states are kept",
                stacklevel=2,
            )
        return {}
    device_state = get_device_rng_state(get_rng_tracker().device)
    entries: dict[str, torch.Tensor | str] = {}
    for key in saved:
        if not key.startswith(prefix + "."):
            continue
        name = key[len(prefix) + 1 :]
        if name in ("python", "numpy"):
            entries[key] = ""
        elif name == "torch":
            entries[key] = torch.empty_like(torch.get_rng_state())
        else:  # "device" or a tracker stream: states of the device generator
            entries[key] = torch.empty_like(device_state)
    return entries


def restore_rng_state(entries: dict, groups: ProcessGroupCollection) -> None:
    """Set this rank's generators from the entries of ``rng_entries_to_load``, now loaded."""
    prefix = _layout_and_prefix(groups)[1] + "."
    tracker = get_rng_tracker()
    streams = {}
    for key, value in entries.items():
        name = key[len(prefix) :]
        if name == "python":
            version, internal, gauss = json.loads(value)
            random.setstate((version, tuple(internal), gauss))
        elif name == "numpy":
            kind, key_words, position, has_gauss, gauss = json.loads(value)
            np.random.set_state((kind, np.array(key_words, dtype=np.uint32), position, has_gauss, gauss))
        elif name == "torch":
            torch.set_rng_state(value)
        elif name == "device":
            set_device_rng_state(value, tracker.device)
        elif name.startswith(_TRACKER):
            streams[name[len(_TRACKER) :]] = value
    tracker.set_states(tracker.get_states() | streams)
