"""Reading back the scalars a run wrote to TensorBoard event files."""

import importlib.util

import pytest

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="needs the tensorboard extra: pip install 'mcore-models[tensorboard]'",
)


def read_scalars(directory):
    """``{tag: {step: value}}`` of the TensorBoard event files in ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {
        tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
