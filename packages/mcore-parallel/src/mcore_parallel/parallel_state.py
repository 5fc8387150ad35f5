"""A global shim over one ``ProcessGroupCollection``, for code that expects module-level getters.

``initialize_model_parallel`` builds the dense and expert grids and every group once; the getters
read them. Modules in this package also accept their groups explicitly and need none of this.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .process_groups.collection import ProcessGroupCollection
from .process_groups.hyper_comm_grid import HyperCommGrid
from .process_groups.layout import DEFAULT_ORDER, make_parallel_grids

__all__ = [
    "destroy_model_parallel",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_dense_grid",
    "get_embedding_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_grid",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_process_group_collection",
    "get_tensor_and_context_parallel_group",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "model_parallel_is_initialized",
    "set_virtual_pipeline_model_parallel_rank",
]


class _State:
    collection: ProcessGroupCollection | None = None
    dense: HyperCommGrid | None = None
    expert: HyperCommGrid | None = None
    virtual_pipeline_size: int | None = None
    virtual_pipeline_rank: int | None = None


_state = _State()


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
    **group_options: Any,
) -> ProcessGroupCollection:
    """Create all model-parallel groups over the default process group and make them global.

    Collective: every rank calls it with the same arguments. See ``make_parallel_grids`` for the
    layout; ``group_options`` go to ``torch.distributed.new_group``. Returns this rank's collection.

    Raises:
        RuntimeError: no default process group, or groups were already initialized.
        ValueError: the sizes do not fit the world (see ``make_parallel_grids``), or
            ``virtual_pipeline_model_parallel_size`` is given with fewer than 2 pipeline stages.
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group first")
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel first")
    if virtual_pipeline_model_parallel_size is not None and (
        virtual_pipeline_model_parallel_size < 1 or pipeline_model_parallel_size < 2
    ):
        raise ValueError(
            "virtual_pipeline_model_parallel_size must be >= 1 and needs pipeline_model_parallel_size >= 2; "
            f"got {virtual_pipeline_model_parallel_size} and {pipeline_model_parallel_size}"
        )
    dense, expert = make_parallel_grids(
        dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        order=order,
    )
    collection = ProcessGroupCollection.from_grids(dense, expert, **group_options)
    _state.collection, _state.dense, _state.expert = collection, dense, expert
    _state.virtual_pipeline_size = virtual_pipeline_model_parallel_size
    _state.virtual_pipeline_rank = 0 if virtual_pipeline_model_parallel_size is not None else None
    return collection


def model_parallel_is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run (and ``destroy_model_parallel`` has not since)."""
    return _state.collection is not None


def destroy_model_parallel() -> None:
    """Forget the global groups, so ``initialize_model_parallel`` may run again."""
    _state.collection = _state.dense = _state.expert = None
    _state.virtual_pipeline_size = _state.virtual_pipeline_rank = None


def get_process_group_collection() -> ProcessGroupCollection:
    """The collection made by ``initialize_model_parallel``."""
    if _state.collection is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel")
    return _state.collection


def get_dense_grid() -> HyperCommGrid:
    """The grid of dense layers (dims ``tp, cp, dp, pp``)."""
    get_process_group_collection()
    return _state.dense


def get_expert_grid() -> HyperCommGrid:
    """The grid of expert layers (dims ``tp, ep, dp, pp``): a view of the same ranks."""
    get_process_group_collection()
    return _state.expert


def _group(name: str) -> dist.ProcessGroup:
    return getattr(get_process_group_collection(), name)


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor-parallel group."""
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    """Size of the tensor-parallel group."""
    return dist.get_world_size(_group("tp"))


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return dist.get_rank(_group("tp"))


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    """This rank's pipeline group (ordered by stage)."""
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return dist.get_world_size(_group("pp"))


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return dist.get_rank(_group("pp"))


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's data-parallel group, or data x context parallel with ``with_context_parallel``."""
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the data-parallel (or data x context parallel) group."""
    return dist.get_world_size(get_data_parallel_group(with_context_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its data-parallel (or data x context parallel) group."""
    return dist.get_rank(get_data_parallel_group(with_context_parallel))


def get_context_parallel_group() -> dist.ProcessGroup:
    """This rank's context-parallel group."""
    return _group("cp")


def get_context_parallel_world_size() -> int:
    """Size of the context-parallel group."""
    return dist.get_world_size(_group("cp"))


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    return dist.get_rank(_group("cp"))


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor x context parallel group."""
    return _group("tp_cp")


def get_model_parallel_group() -> dist.ProcessGroup:
    """This rank's model-parallel (tensor x pipeline) group."""
    return _group("mp")


def get_embedding_group() -> dist.ProcessGroup | None:
    """The group of the first and last pipeline stage; ``None`` on the stages in between."""
    return _group("embd")


def get_expert_model_parallel_group() -> dist.ProcessGroup:
    """This rank's expert-parallel group."""
    return _group("ep")


def get_expert_model_parallel_world_size() -> int:
    """Size of the expert-parallel group."""
    return dist.get_world_size(_group("ep"))


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert-parallel group."""
    return dist.get_rank(_group("ep"))


def get_expert_tensor_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor-parallel group inside expert layers."""
    return _group("expert_tp")


def get_expert_tensor_parallel_world_size() -> int:
    """Size of the expert tensor-parallel group."""
    return dist.get_world_size(_group("expert_tp"))


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert tensor-parallel group."""
    return dist.get_rank(_group("expert_tp"))


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """This rank's data-parallel group inside expert layers."""
    return _group("expert_dp")


def get_expert_data_parallel_world_size() -> int:
    """Size of the expert data-parallel group."""
    return dist.get_world_size(_group("expert_dp"))


def get_expert_data_parallel_rank() -> int:
    """This rank's index in its expert data-parallel group."""
    return dist.get_rank(_group("expert_dp"))


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline stage with interleaving, else ``None``."""
    return _state.virtual_pipeline_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The model chunk being run with interleaving, else ``None``."""
    return _state.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Select the model chunk being run (interleaved schedules)."""
    size = _state.virtual_pipeline_size
    if size is None or not 0 <= rank < size:
        raise ValueError(f"virtual pipeline rank must be in 0..{(size or 1) - 1} (size {size}), got {rank}")
    _state.virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the first pipeline stage (and, unless ``ignore_virtual``, the first chunk)."""
    if not ignore_virtual and _state.virtual_pipeline_rank not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ``ignore_virtual``, the last chunk)."""
    size = _state.virtual_pipeline_size
    if not ignore_virtual and size is not None and _state.virtual_pipeline_rank != size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def _pipeline_neighbour(step: int) -> int:
    ranks = get_dense_grid().group_ranks("pp", dist.get_rank())
    return ranks[(ranks.index(dist.get_rank()) + step) % len(ranks)]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (the first after the last)."""
    return _pipeline_neighbour(+1)


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous pipeline stage (the last before the first)."""
    return _pipeline_neighbour(-1)
