"""``--fsdp`` with tensor parallelism: tensor-parallel slices held whole in checkpoints.

mcore-fsdp shards each rank's tensor-parallel slice of a parameter over the data-parallel mesh, so
its state dicts hold DTensors of the slice's shape. A checkpoint holds such a parameter, and its
optimizer states, whole: gathered over the data- and tensor-parallel groups, under its own name, so
it loads at any tensor-parallel size. Loading cuts this rank's slice back out, as a replicated
DTensor over the data-parallel mesh, which mcore-fsdp shards as it loads. Parameters that tensor
parallelism does not split are the same on every tensor-parallel rank: they are saved as they are,
and the gradient norm counts them once. Experts are left to ``fsdp_experts``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import get_group_device
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..hf.sharding import gather_full_tensor, shard_full_tensor


def _split(param: torch.nn.Parameter) -> bool:
    return getattr(param, "tensor_model_parallel", False) and not getattr(param, "expert_parallel", False)


class TensorParallelNames:
    """Converts the tensor-parallel slices in a sharded ``GPTModel``'s state dicts to whole tensors
    and back, and counts replicated gradients once.

    Built before ``fully_shard`` on every rank; ``mesh_group`` is the group the model is sharded over.
    """

    def __init__(self, model: torch.nn.Module, tp_group: dist.ProcessGroup, mesh_group: dist.ProcessGroup):
        self.tp_group = tp_group
        self.size, self.rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.mesh = DeviceMesh.from_group(mesh_group, get_group_device(mesh_group).type)
        # every name of a split parameter: a tied output layer's weight is the embedding's
        self.slices = {
            name: param for name, param in model.named_parameters(remove_duplicate=False) if _split(param)
        }

    def whole_numel(self, name: str, numel: int) -> int:
        """The size of the whole tensor whose slice ``name`` of ``numel`` elements is."""
        return numel * self.size if name in self.slices else numel

    def copies_outside_mesh(self, param: torch.nn.Parameter) -> int:
        """How many tensor-parallel ranks hold ``param``'s gradient: a dense parameter that tensor
        parallelism does not split is on each of them (experts: see ``fsdp_experts``)."""
        replicated = not getattr(param, "tensor_model_parallel", False)
        return self.size if replicated and not getattr(param, "expert_parallel", False) else 1

    def to_global(self, name: str, value):
        """``(name, whole tensor)`` for a split parameter's entry (collective), else unchanged."""
        param = self.slices.get(name)
        if param is None or value is None or value.dim() == 0:  # a step count
            return name, value
        local = value.full_tensor() if isinstance(value, DTensor) else value
        return name, gather_full_tensor(param, self.tp_group, local)

    def to_local(self, name: str, value):
        """The inverse of ``to_global``: this rank's slice, replicated over the data-parallel mesh."""
        param = self.slices.get(name)
        if param is None or value is None or value.dim() == 0:
            return name, value
        whole = value.to_local() if isinstance(value, DTensor) else value
        piece = shard_full_tensor(param, whole, self.rank, self.size).contiguous()
        return name, DTensor.from_local(piece, self.mesh, [Replicate()], run_check=False)
