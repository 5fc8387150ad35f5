"""Process groups per module, for models whose modules live on different grids (e.g. encoder, decoder)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ..config.ddp import DistributedDataParallelConfig
from ..distributed.data_parallel import DistributedDataParallel
from ..process_groups.collection import ProcessGroupCollection
from ..process_groups.hyper_comm_grid import HyperCommGrid


@experimental_api
class MultiModuleProcessGroups:
    """Each named module's grid and its ``tp`` / ``dp`` groups, so its collectives stay in its grid.

    ``from_grids`` is collective over the default group (every rank creates every group). A rank
    takes part in the modules whose grid holds it (``local_modules``); ``wrap_ddp`` gives such a
    module its own ``DistributedDataParallel`` over that module's data-parallel group, so each
    module reduces its gradients in buckets of its own.
    """

    def __init__(self, grids: dict[str, HyperCommGrid], groups: dict[str, ProcessGroupCollection]):
        self.grids, self.groups = grids, groups

    @classmethod
    def from_grids(cls, grids: dict[str, HyperCommGrid]) -> MultiModuleProcessGroups:
        """Create the ``tp`` and ``dp`` groups of every grid (dims must include ``tp`` and ``dp``)."""
        groups = {
            name: ProcessGroupCollection(tp=grid.create_group("tp"), dp=grid.create_group("dp"))
            for name, grid in grids.items()
        }
        return cls(grids, groups)

    def local_modules(self) -> list[str]:
        """Names of the modules whose grid holds this rank."""
        rank = dist.get_rank()
        return [n for n, g in self.grids.items() if g.rank_offset <= rank < g.rank_offset + g.size]

    def __getitem__(self, name: str) -> ProcessGroupCollection:
        if name not in self.groups:
            raise KeyError(f"unknown module {name!r}; modules are {sorted(self.groups)}")
        return self.groups[name]

    def wrap_ddp(
        self, name: str, module: torch.nn.Module, config: DistributedDataParallelConfig | None = None
    ) -> DistributedDataParallel:
        """``module`` (the local part of module ``name``) under DDP over that module's data-parallel group."""
        if name not in self.local_modules():
            raise ValueError(f"this rank is not in the grid of module {name!r}")
        return DistributedDataParallel(module, config, self[name].dp)
