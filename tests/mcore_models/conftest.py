"""Helpers for mcore-models tests: process groups inside forked ranks."""

import pytest


@pytest.fixture
def model_parallel():
    """``model_parallel(tp, **sizes)`` inside a rank: the ``ProcessGroupCollection`` of
    ``initialize_model_parallel`` (``sizes``: its other sizes, e.g. ``expert_model_parallel_size``;
    torn down and rebuilt if the forked rank inherited one)."""
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    def setup(tensor_model_parallel_size: int = 1, **sizes):
        destroy_model_parallel()
        return initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size, **sizes)

    return setup
