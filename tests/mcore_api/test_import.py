"""Importing mcore_api is side-effect free: no CUDA, no optional accelerator."""

from mcore_testing.imports import assert_imports_cleanly


def test_import_touches_no_cuda_and_no_accelerator():
    assert_imports_cleanly("mcore_api", "mcore-api")
