"""``ProcessGroupCollection``: the process groups a model needs, passed explicitly to its modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .hyper_comm_grid import HyperCommGrid

# Collection field -> the dense-grid dimensions its group spans.
_DENSE_GROUPS = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "dp": "dp",
    "tp_cp": "tp-cp",
    "dp_cp": "dp-cp",
    "tp_dp_cp": "tp-dp-cp",
    "mp": "tp-pp",
}
# Collection field -> the expert-grid dimensions its group spans.
_EXPERT_GROUPS = {
    "ep": "ep",
    "expert_tp": "tp",
    "expert_dp": "dp",
    "tp_ep": "tp-ep",
}


@dataclass
class ProcessGroupCollection:
    """The groups of one rank. A field is ``None`` when the layout did not create that group.

    Dense layers: ``tp`` tensor, ``cp`` context, ``pp`` pipeline, ``dp`` data parallel; ``tp_cp``,
    ``dp_cp``, ``tp_dp_cp`` their products; ``mp`` model parallel (tensor x pipeline). Experts:
    ``ep`` expert parallel, ``expert_tp`` and ``expert_dp`` tensor and data parallel among expert
    layers, ``tp_ep`` expert-tensor x expert. ``embd``: the first and last pipeline stages, which
    share tied embeddings.
    """

    tp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    tp_dp_cp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    expert_tp: dist.ProcessGroup | None = None
    expert_dp: dist.ProcessGroup | None = None
    tp_ep: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None

    @classmethod
    def from_grids(
        cls, dense: HyperCommGrid, expert: HyperCommGrid, **options: Any
    ) -> ProcessGroupCollection:
        """Create every group of the dense grid and its expert view (collective over the default group).

        ``options`` go to ``torch.distributed.new_group``.
        """
        groups = {name: dense.create_group(dims, **options) for name, dims in _DENSE_GROUPS.items()}
        groups |= {name: expert.create_group(dims, **options) for name, dims in _EXPERT_GROUPS.items()}
        groups["embd"] = _embedding_group(dense, groups["pp"], **options)
        return cls(**groups)


def _embedding_group(dense: HyperCommGrid, pp_group: dist.ProcessGroup | None, **options: Any):
    """The group of the first and last stage of this rank's pipeline (the pipeline group if it has <= 2)."""
    my_rank = dist.get_rank()
    mine = None
    for pipeline in dense.rank_groups("pp"):
        ends = sorted({pipeline[0], pipeline[-1]})
        if ends == pipeline:
            group = pp_group if my_rank in pipeline else None
        else:
            group = dist.new_group(ends, **options)
        if my_rank in ends:
            mine = group
    return mine
