"""``--fsdp`` with pipeline parallelism: a stage's layers under their global index in checkpoints.

Each pipeline stage shards its own ``GPTModel`` (its layers, and the embedding or the output layer
at the ends) over the data-parallel group; mcore-fsdp names the layers ``decoder.layers.<i>`` from
0 on every stage. A checkpoint names them as the whole model does, ``decoder.layers.<first + i>``,
so it loads at any pipeline size.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class StageLayerNames:
    """Renumbers the layers of one stage's sharded ``GPTModel`` in its state dicts, and back."""

    def __init__(self, model: torch.nn.Module):
        layers = model.decoder.layers
        self.first = layers[0].layer_number - 1 if len(layers) else 0

    def whole_numel(self, name: str, numel: int) -> int:
        """Renaming does not change sizes."""
        return numel

    def copies_outside_mesh(self, param: torch.nn.Parameter) -> int:
        """Other stages hold other parameters."""
        return 1

    def to_global(self, name: str, value):
        """``decoder.layers.<i>.…`` -> ``decoder.layers.<first + i>.…``; other names unchanged."""
        return self._shifted(name, self.first), value

    def to_local(self, name: str, value):
        """The inverse of ``to_global``."""
        return self._shifted(name, -self.first), value

    @staticmethod
    def _shifted(name: str, by: int) -> str:
        match = _LAYER.match(name)
        if match is None or by == 0:
            return name
        return f"decoder.layers.{int(match[1]) + by}.{name[match.end() :]}"
