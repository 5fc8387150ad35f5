"""Importing mcore_models is side-effect free: no CUDA, no optional accelerator."""

from importlib.metadata import version

from mcore_testing.imports import import_in_fresh_interpreter


def test_import_touches_no_cuda_and_no_accelerator():
    report = import_in_fresh_interpreter("mcore_models")
    assert report["cuda_initialized"] in (False, None)
    assert report["accelerators"] == []
    assert report["version"] == version("mcore-models")
    assert "__version__" in report["all"]
