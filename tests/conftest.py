"""Suite-wide pytest wiring: the distributed harness fixture, GPU skipping, CPU tests kept off
the GPU, and the Triton-interpreter tests deferred to the end while their runs go on in the
background (``mcore_testing.triton_interpreter``).

Nothing here imports torch or an mcore package at import time: the same conftest serves
``mcore-api``'s tests in an environment that has neither.

On a machine with a GPU the suite runs in three parts, because ranks are forked and a fork cannot
use CUDA (nor run autograd) once the test process has initialized CUDA:

1. the ``gpu`` tests whose body runs on forked ranks (``run_distributed``): the test process never
   touches CUDA itself;
2. the CPU/gloo suite, with the GPU hidden (``CUDA_VISIBLE_DEVICES=""``), so it runs as it does on
   a machine without one;
3. the ``gpu`` tests that use CUDA in the test process, with the GPU visible again: after them no
   test forks.
"""

import os

import pytest
from mcore_testing.distributed import run_distributed as _run_distributed
from mcore_testing.triton_interpreter import defer_interpreted


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
    if not gpu_items:
        return
    if not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
        for item in gpu_items:
            item.add_marker(skip)
        return
    forked = [item for item in gpu_items if item.get_closest_marker("distributed")]
    in_process = [item for item in gpu_items if not item.get_closest_marker("distributed")]
    cpu = [item for item in items if not item.get_closest_marker("gpu")]
    items[:] = forked + cpu + in_process


def pytest_collection_finish(session):
    defer_interpreted(session.items)


_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif _VISIBLE_DEVICES is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = _VISIBLE_DEVICES


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
