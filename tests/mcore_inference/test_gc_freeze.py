"""The engine freezes Python's garbage-collector heap when built (``freeze_gc``, on by default, as
vLLM's engine does): what is alive then is never scanned again by cyclic collections."""

import gc

import pytest


@pytest.fixture
def unfrozen():
    """Start from a heap with nothing frozen, and leave it so."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _scanned(obj) -> bool:
    """Whether cyclic collections still scan ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.usefixtures("unfrozen")
def test_a_new_engine_freezes_what_is_alive(make_model, make_engine):
    model = make_model()
    assert _scanned(model)
    make_engine(model)
    assert gc.get_freeze_count() > 0 and not _scanned(model)
    made_after = {"key": []}
    assert _scanned(made_after)


@pytest.mark.usefixtures("unfrozen")
def test_freeze_gc_false_leaves_the_collector_alone(make_model, make_engine):
    model = make_model()
    make_engine(model, freeze_gc=False)
    assert gc.get_freeze_count() == 0 and _scanned(model)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_freeze_gc_must_be_a_bool(make_model, make_engine, value):
    with pytest.raises(TypeError, match="freeze_gc must be a bool"):
        make_engine(make_model(), freeze_gc=value)
