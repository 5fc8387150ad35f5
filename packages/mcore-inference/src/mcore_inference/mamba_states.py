"""Per-request conv and SSM states of a hybrid model's Mamba layers: one slot per active request."""

from __future__ import annotations

import torch
from mcore_api import internal_api
from mcore_models import MambaInferenceStateConfig


@internal_api
class MambaStateSlots:
    """``slots`` rows of state per Mamba layer of ``config`` on ``device``: a request takes a slot
    when it is first laid out in a step (``take``) and keeps it until ``drop``; a request laid out
    from its first token gets its slot zeroed, so a restart (preemption, suspend/resume, a retry)
    recomputes its state from scratch."""

    def __init__(self, config: MambaInferenceStateConfig, slots: int, device: torch.device):
        self.config, self.num_slots, self.device = config, slots, device
        self._layer = {number: i for i, number in enumerate(config.layers_of_type("mamba"))}
        self.conv: torch.Tensor | None = None  # [mamba layers, slots, *conv_state_shape]
        self.ssm: torch.Tensor | None = None  # [mamba layers, slots, *ssm_state_shape]
        self._slot: dict[int, int] = {}  # request id -> slot
        self._free = list(range(slots - 1, -1, -1))

    def __len__(self) -> int:
        """Slots that requests hold."""
        return len(self._slot)

    @property
    def memory_bytes(self) -> int:
        """Bytes the state tensors take while allocated."""
        return self.num_slots * self.config.state_bytes()

    def allocate(self) -> None:
        """Create the (zeroed) state tensors and free every slot."""
        layers, config = len(self._layer), self.config
        self.conv = torch.zeros(
            layers, self.num_slots, *config.conv_state_shape, dtype=config.conv_dtype, device=self.device
        )
        self.ssm = torch.zeros(
            layers, self.num_slots, *config.ssm_state_shape, dtype=config.ssm_dtype, device=self.device
        )
        self.reset()

    def deallocate(self) -> None:
        """Free the state tensors and every slot."""
        self.conv = self.ssm = None
        self.reset()

    def reset(self) -> None:
        """Free every slot."""
        self._slot.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def take(self, request_id: int, *, fresh: bool) -> int:
        """The slot of ``request_id``, given one if it has none; zeroed when ``fresh`` (the
        request's step starts at its first token)."""
        slot = self._slot.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"all {self.num_slots} Mamba state slots are taken (max_requests)")
            slot = self._slot[request_id] = self._free.pop()
        if fresh:
            self.conv[:, slot].zero_()
            self.ssm[:, slot].zero_()
        return slot

    def drop(self, request_id: int) -> None:
        """Free ``request_id``'s slot (no-op if it has none)."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM states ``[slots, ...]`` of Mamba layer ``layer_number``."""
        index = self._layer.get(layer_number)
        if index is None:
            raise ValueError(f"layer {layer_number} is not a Mamba layer of this context {list(self._layer)}")
        return self.conv[index], self.ssm[index]
