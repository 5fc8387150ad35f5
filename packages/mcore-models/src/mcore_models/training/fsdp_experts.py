"""``--fsdp`` with expert parallelism: the sharded model's expert entries under global names.

mcore-fsdp gives expert parameters as DTensors over the expert-data-parallel mesh, under the
names of this rank's local experts. A checkpoint names them as DDP's does (see
``checkpointing._global_names``), so any expert-parallel size loads it: ``local_experts.<j>``
becomes ``local_experts.<first + j>``, and a tensor stacked by expert (``GroupedExperts``) becomes
this rank's slice of the global stack, a DTensor over the ``(expert, expert-data)`` mesh with
rows sharded along both (``[Shard(0), Shard(0)]``).

With expert tensor parallelism a slice of an expert (``expert_tensor_parallel_dim`` set) is saved
whole, as ``expert_tp_checkpoint`` saves it without ``--fsdp``: gathered over the
expert-data-parallel and expert-tensor-parallel groups (a stacked one then ``[Shard(0),
Replicate()]`` over the ``(expert, expert-data)`` mesh), so a checkpoint loads at any
expert-tensor-parallel size; loading cuts this rank's slice back out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from mcore_parallel import get_group_device
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..transformer.moe import MoELayer
from ..transformer.moe.expert_names import global_expert_name
from ..transformer.moe.expert_sharding import EXPERT_TP_DIM, expert_tp_size, gather_slices, shard


@dataclass(frozen=True)
class _ExpertPrefix:
    prefix: str  # the experts module's name in the model, with a trailing dot
    first: int  # the global index of this rank's first expert


class ExpertCheckpointNames:
    """Maps the expert entries of a sharded ``GPTModel``'s state dicts to global names and back.

    Built on every rank of the model (a collective over ``ep_group``); ``expert_tp_group`` splits
    the experts where it has more than one rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ep_group: dist.ProcessGroup,
        expert_dp_group: dist.ProcessGroup,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        self.layers = [
            _ExpertPrefix(f"{name}.experts.", layer.local_expert_offset)
            for name, layer in model.named_modules()
            if isinstance(layer, MoELayer)
        ]
        self.ep_group = ep_group
        self.mesh = _expert_mesh(ep_group, expert_dp_group)
        # the 1-D mesh of mcore-fsdp's expert DTensors (any mesh over the group serves)
        self.expert_dp_mesh = DeviceMesh.from_group(expert_dp_group, self.mesh.device_type)
        self.expert_tp_group = expert_tp_group
        self.etp = expert_tp_size(expert_tp_group)
        # the expert slices by their local names
        self.slices = {
            name: param
            for name, param in model.named_parameters()
            if getattr(param, EXPERT_TP_DIM, None) is not None
        }

    def _layer(self, name: str) -> _ExpertPrefix | None:
        return next((layer for layer in self.layers if name.startswith(layer.prefix)), None)

    def is_expert(self, name: str) -> bool:
        """Whether ``name`` (a local name) is an expert's."""
        return self._layer(name) is not None

    def whole_numel(self, name: str, numel: int) -> int:
        """The size of the whole tensor whose slice ``name`` (a local name) of ``numel`` elements is."""
        return numel * self.etp if name in self.slices else numel

    def copies_outside_mesh(self, param: torch.nn.Parameter) -> int:
        """How many expert-tensor-parallel ranks hold ``param``'s gradient: an expert tensor not
        split over them (FC2's bias) is on each, anything else is on one."""
        unsplit = getattr(param, "expert_parallel", False) and getattr(param, EXPERT_TP_DIM, None) is None
        return self.etp if unsplit else 1

    def to_global(self, name: str, value):
        """``(global name, value)``: renumbered or, for a stacked tensor, its slice of the global stack."""
        return self._convert(name, value, to_global=True)

    def to_local(self, name: str, value):
        """The inverse of ``to_global``."""
        return self._convert(name, value, to_global=False)

    def _convert(self, name: str, value, to_global: bool):
        layer = self._layer(name)
        if layer is None:
            return name, value
        renamed = global_expert_name(name, layer.first if to_global else -layer.first)
        param = self.slices.get(name if to_global or renamed is None else renamed)
        if param is not None and value is not None and value.dim() > 0:  # not a step count
            return renamed or name, self._whole(value, param, renamed is None, to_global)
        if renamed is not None:
            return renamed, value
        if not isinstance(value, DTensor):
            return name, value
        ep = self.mesh.size(0)
        if to_global:
            rows, mesh, placements = value.shape[0] * ep, self.mesh, [Shard(0), *value.placements]
        else:
            rows, mesh, placements = value.shape[0] // ep, self.expert_dp_mesh, value.placements[1:]
        shape = torch.Size((rows, *value.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        return name, DTensor.from_local(
            value.to_local(), mesh, placements, run_check=False, shape=shape, stride=stride
        )

    def _whole(self, value, param: torch.Tensor, stacked: bool, to_global: bool):
        """``param``'s slice ``value`` gathered whole (collective), or the inverse: this rank's
        slice of the whole tensor, a replicated DTensor over the expert-data-parallel mesh."""
        if not to_global:
            whole = value.to_local() if isinstance(value, DTensor) else value
            dim, gated = getattr(param, EXPERT_TP_DIM), getattr(param, "gated_halves", False)
            piece = shard(whole, dim, dist.get_rank(self.expert_tp_group), self.etp, gated)
            return DTensor.from_local(piece, self.expert_dp_mesh, [Replicate()], run_check=False)
        whole = gather_slices(value.full_tensor(), param, self.expert_tp_group)
        if not stacked:
            return whole
        shape = torch.Size((whole.shape[0] * self.mesh.size(0), *whole.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        placements = [Shard(0), Replicate()]
        return DTensor.from_local(whole, self.mesh, placements, run_check=False, shape=shape, stride=stride)


def _expert_mesh(ep_group: dist.ProcessGroup, expert_dp_group: dist.ProcessGroup) -> DeviceMesh:
    """The ``(ep, expert_dp)`` mesh of this rank's expert slice (a collective over ``ep_group``)."""
    rows = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(rows, dist.get_process_group_ranks(expert_dp_group), group=ep_group)
    return DeviceMesh.from_group(
        [ep_group, expert_dp_group],
        get_group_device(ep_group).type,
        mesh=torch.tensor(rows),
        mesh_dim_names=("ep", "expert_dp"),
    )
