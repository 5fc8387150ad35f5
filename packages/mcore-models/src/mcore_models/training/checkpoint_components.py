"""The ``Stateful`` components of a training checkpoint beside the model: the loss history and each
rank's random-number states.

The model and optimizer tensors come from ``TrainModel.checkpoint_state`` (``ParamStatesCheckpoint``
in ``checkpointing``, or ``FSDPCheckpoint`` with ``--fsdp``). The learning-rate schedule and the data
position are pure functions of the iteration, which the checkpoint directory records, so they add
no entries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mcore_parallel import DistributedCheckpointer, ProcessGroupCollection

from .random_states import restore_rng_state, rng_checkpoint_state, rng_entries_to_load

HISTORY_KEY = "history"


class LossHistory:
    """The loss curve so far (``{"train", "heldout", "lr"}`` lists), as JSON text under ``history``.

    ``loading``: ``state_dict()`` gives a placeholder for the load to fill."""

    def __init__(self, history: dict | None = None, *, loading: bool = False):
        self.history = history if history is not None else {}
        self.loading = loading

    def state_dict(self) -> dict[str, str]:
        """``{"history": JSON text}`` (an empty placeholder when loading)."""
        return {HISTORY_KEY: "" if self.loading else json.dumps(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Read the loaded history."""
        self.history = json.loads(state[HISTORY_KEY])


class RandomStates:
    """This rank's random-number states (see ``random_states``): saved from the generators, or the
    entries to load (``to_load``, possibly none) restored into them."""

    def __init__(self, groups: ProcessGroupCollection, to_load: dict | None = None):
        self.groups, self.to_load = groups, to_load

    @classmethod
    def for_load(cls, checkpointer: DistributedCheckpointer, groups: ProcessGroupCollection) -> RandomStates:
        """The entries of the latest checkpoint this rank restores (collective; see ``rng_entries_to_load``)."""
        return cls(groups, rng_entries_to_load(checkpointer, groups))

    def state_dict(self) -> dict[str, Any]:
        """The current states, or the placeholders to load."""
        return rng_checkpoint_state(self.groups) if self.to_load is None else self.to_load

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the generators from the loaded entries (nothing when there were none to load)."""
        if self.to_load:
            restore_rng_state({key: state[key] for key in self.to_load}, self.groups)
