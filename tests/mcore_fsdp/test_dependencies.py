"""mcore-fsdp installs alone into any trainer: it requires torch and mcore-api, nothing else."""

from importlib.metadata import requires

from packaging.requirements import Requirement


def test_requires_only_torch_and_mcore_api():
    required = {
        Requirement(text).name
        for text in requires("mcore-fsdp") or []
        if Requirement(text).marker is None  # extras carry a marker; there are none today
    }
    assert required == {"torch", "mcore-api"}
