"""The process groups a model uses: given explicitly, or the global ones of ``initialize_model_parallel``."""

from __future__ import annotations

from mcore_parallel import ProcessGroupCollection
from mcore_parallel.parallel_state import get_process_group_collection, model_parallel_is_initialized


def resolve_process_groups(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    """``pg_collection`` itself, else the global collection.

    Raises:
        RuntimeError: neither is available (call ``torch.distributed.init_process_group`` and
            ``mcore_parallel.initialize_model_parallel`` first, even for one process).
    """
    if pg_collection is not None:
        return pg_collection
    if not model_parallel_is_initialized():
        raise RuntimeError(
            "no process groups: pass pg_collection, or call torch.distributed.init_process_group and "
            "mcore_parallel.initialize_model_parallel first (a single process needs a world of size 1)"
        )
    return get_process_group_collection()
