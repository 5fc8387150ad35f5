"""The learning-rate schedules by hand."""

import math

import pytest
from mcore_models.training import SchedulerConfig, learning_rate


def _lr(step, **config):
    return learning_rate(step, 1.0, SchedulerConfig(lr_warmup_iters=10, min_lr=0.1, **config), 110)


def test_warmup_then_cosine():
    assert _lr(5) == pytest.approx(0.5) and _lr(10) == pytest.approx(1.0)
    assert _lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert _lr(110) == pytest.approx(0.1) and _lr(500) == pytest.approx(0.1)


def test_linear_and_constant():
    assert _lr(60, lr_decay_style="linear") == pytest.approx(0.55)
    assert _lr(100, lr_decay_style="constant") == 1.0


def test_wsd_is_stable_until_its_decay():
    wsd = dict(lr_decay_style="WSD", lr_wsd_decay_iters=20)
    assert _lr(90, **wsd) == 1.0
    assert _lr(100, **wsd) == pytest.approx(0.55)
    assert _lr(110, **wsd) == pytest.approx(0.1)
    assert _lr(90, lr_decay_style="WSD") == 1.0  # default decay: the last 20 % (20 of 100 iterations)
    assert _lr(91, lr_decay_style="WSD") < 1.0
