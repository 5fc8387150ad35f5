"""``mcore_inference.__all__`` holds user-facing names, each with a docstring and a place in the
README, and the engine's step machinery marked ``mcore_api.internal_api`` (still importable,
exempt from compatibility, to leave ``__all__`` in a later release)."""

import inspect
from pathlib import Path

import mcore_inference
import pytest

README = Path(__file__).parents[2] / "packages" / "mcore-inference" / "README.md"
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
USER_FACING = sorted(set(mcore_inference.__all__) - INTERNAL)


def _stability(obj):
    return getattr(obj, "__mcore_api_stability__", None)


def test_step_internals_and_only_they_are_marked_internal():
    marked = {name for name in mcore_inference.__all__ if _stability(getattr(mcore_inference, name))}
    assert marked == INTERNAL
    assert {_stability(getattr(mcore_inference, name)) for name in INTERNAL} == {"internal"}
    context = mcore_inference.DynamicInferenceContext
    assert _stability(context.prepare_step) == _stability(context.prepare_padded_decode) == "internal"


@pytest.mark.parametrize("name", USER_FACING)
def test_user_facing_names_are_documented(name):
    assert f"`{name}" in README.read_text() or f"mcore_inference.{name}" in README.read_text()
    obj = getattr(mcore_inference, name)
    if name == "__version__":
        return
    assert obj.__doc__ and not obj.__doc__.startswith(f"{name}("), "no docstring of its own"
    members = vars(obj).items() if inspect.isclass(obj) else ()
    for member, value in members:
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if not member.startswith("_") and callable(function):
            assert function.__doc__, f"{name}.{member} has no docstring"
