"""mcore_inference's public surface: the engine's step machinery is marked ``internal_api`` (still
importable, exempt from compatibility, to leave ``__all__`` in a later release); every name, and
every public method of a user-facing class, is documented in its docstring and in the README."""

import inspect

import mcore_inference
from mcore_inference.model_runner import ModelRunner
from mcore_testing.public_api import missing_from_readme, stability_markers, undocumented

# Changing this is an API decision: internal names may leave __all__ in a later release.
INTERNAL = {
    "BlockAllocator",
    "DecodeBuffers",
    "DecodeGraphRunner",
    "DecodeView",
    "SampledTokens",
    "ScheduledChunk",
    "Scheduler",
    "block_hash",
    "filter_logits",
    "match_bucket",
    "paged_attention",
    "sample",
}


def test_stability_markers():
    assert stability_markers("mcore_inference") == dict.fromkeys(INTERNAL, "internal")
    assert ModelRunner.__mcore_api_stability__ == "internal"  # lays steps out in the context


def test_every_public_name_has_a_docstring():
    assert undocumented("mcore_inference") == []
    missing = []
    for name in sorted(set(mcore_inference.__all__) - INTERNAL):
        obj = getattr(mcore_inference, name)
        for member, value in vars(obj).items() if inspect.isclass(obj) else ():
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not member.startswith("_") and callable(function) and not function.__doc__:
                missing.append(f"{name}.{member}")
    assert missing == []


def test_every_public_name_is_in_the_readme():
    assert missing_from_readme(["mcore_inference"], "mcore-inference") == []


def test_the_server_is_documented():
    assert undocumented("mcore_inference.server") == []
    assert missing_from_readme(["mcore_inference.server"], "mcore-inference") == []
