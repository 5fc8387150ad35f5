"""Suite-wide pytest wiring: the distributed harness fixture and GPU skipping.

Nothing here imports torch or an mcore package at import time: the same conftest serves
``mcore-api``'s tests in an environment that has neither.
"""

import pytest
from mcore_testing.distributed import run_distributed as _run_distributed


@pytest.fixture
def run_distributed():
    """``run_distributed(body, world_size, *args, timeout=30, ...)``: run ``body`` on forked ranks.

    See ``mcore_testing.distributed.run_distributed``. Tests using this fixture are marked
    ``distributed`` automatically.
    """
    return _run_distributed


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "run_distributed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
        for item in gpu_items:
            item.add_marker(skip)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
