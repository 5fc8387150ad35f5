"""Every rejected input of the Mamba-2 functions raises ValueError naming the argument."""

import pytest
import torch
from mcore_models.ssm import (
    causal_conv1d,
    causal_conv1d_step,
    gated_rms_norm,
    ssd_chunked_scan,
    ssd_decode_step,
    ssd_naive_recurrence,
)

# batch 2, seqlen 5, nheads 4, headdim 3, ngroups 2, dstate 6
GOOD = {
    "x": torch.zeros(2, 5, 4, 3),
    "dt": torch.ones(2, 5, 4),
    "A": -torch.ones(4),
    "B": torch.zeros(2, 5, 2, 6),
    "C": torch.zeros(2, 5, 2, 6),
    "D": torch.ones(4),
    "initial_state": torch.zeros(2, 4, 3, 6),
}

SEQUENCE_CASES = [
    (
        {"x": torch.zeros(2, 5, 12)},
        r"x must have 4 dimensions \[batch, seqlen, nheads, headdim\]; got shape \[2, 5, 12\]",
    ),
    ({"x": torch.zeros(2, 0, 4, 3)}, r"x must hold at least one token"),
    (
        {"dt": torch.ones(2, 4, 4)},
        r"dt must have shape \[batch, seqlen, nheads\] = \[2, 5, 4\].*got \[2, 4, 4\]",
    ),
    ({"dt": torch.ones(2, 5)}, r"dt must have shape .* got \[2, 5\]"),
    ({"A": -torch.ones(3)}, r"A must have shape \[nheads\] = \[4\].*got \[3\]"),
    ({"B": torch.zeros(2, 5, 12)}, r"B must have 4 dimensions"),
    ({"B": torch.zeros(1, 5, 2, 6)}, r"B must have shape .* = \[2, 5, 2, 6\].*got \[1, 5, 2, 6\]"),
    ({"B": torch.zeros(2, 6, 2, 6)}, r"B must have shape .* = \[2, 5, 2, 6\].*got \[2, 6, 2, 6\]"),
    ({"C": torch.zeros(2, 5, 2, 5)}, r"C must have shape .* = \[2, 5, 2, 6\] to match B; got \[2, 5, 2, 5\]"),
    (
        {"B": torch.zeros(2, 5, 3, 6), "C": torch.zeros(2, 5, 3, 6)},
        r"nheads \(4\) must be a multiple of ngroups \(3",
    ),
    ({"D": torch.ones(4, 3)}, r"D must have shape \[nheads\] = \[4\].*got \[4, 3\]"),
    (
        {"initial_state": torch.zeros(2, 4, 6, 3)},
        r"initial_state must have shape .* = \[2, 4, 3, 6\].*got \[2, 4, 6, 3\]",
    ),
]


def _scan(**kw):
    return ssd_chunked_scan(**kw, chunk_size=4)


@pytest.mark.parametrize("function", [_scan, ssd_naive_recurrence], ids=["chunked", "reference"])
@pytest.mark.parametrize(("bad", "message"), SEQUENCE_CASES)
def test_sequence_functions_reject_bad_shapes(function, bad, message):
    with pytest.raises(ValueError, match=message):
        function(**{**GOOD, **bad})


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_chunk_size_must_be_a_positive_int(chunk_size):
    with pytest.raises(ValueError, match=rf"chunk_size must be an int >= 1, got {chunk_size!r}"):
        ssd_chunked_scan(**GOOD, chunk_size=chunk_size)


STEP_GOOD = {
    "state": torch.zeros(2, 4, 3, 6),
    "x": torch.zeros(2, 4, 3),
    "dt": torch.ones(2, 4),
    "A": -torch.ones(4),
    "B": torch.zeros(2, 2, 6),
    "C": torch.zeros(2, 2, 6),
    "D": torch.ones(4),
}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"state": torch.zeros(2, 4, 18)}, r"state must have 4 dimensions"),
        (
            {"x": torch.zeros(2, 4, 2)},
            r"x must have shape \[batch, nheads, headdim\] = \[2, 4, 3\].*got \[2, 4, 2\]",
        ),
        ({"dt": torch.ones(1, 4)}, r"dt must have shape \[batch, nheads\] = \[2, 4\].*got \[1, 4\]"),
        ({"A": -torch.ones(2)}, r"A must have shape \[nheads\] = \[4\]"),
        ({"B": torch.zeros(2, 12)}, r"B must have 3 dimensions"),
        (
            {"B": torch.zeros(3, 2, 6)},
            r"B must have shape \[batch, ngroups, dstate\] = \[2, 2, 6\].*got \[3, 2, 6\]",
        ),
        ({"C": torch.zeros(2, 1, 6)}, r"C must have shape .* = \[2, 2, 6\] to match B; got \[2, 1, 6\]"),
        (
            {"B": torch.zeros(2, 3, 6), "C": torch.zeros(2, 3, 6)},
            r"nheads \(4\) must be a multiple of ngroups \(3",
        ),
        ({"D": torch.ones(5)}, r"D must have shape \[nheads\] = \[4\].*got \[5\]"),
    ],
)
def test_decode_step_rejects_bad_shapes(bad, message):
    with pytest.raises(ValueError, match=message):
        ssd_decode_step(**{**STEP_GOOD, **bad})


CONV_GOOD = {"x": torch.zeros(2, 5, 3), "weight": torch.zeros(3, 4), "bias": torch.zeros(3)}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"x": torch.zeros(5, 3)},
            r"x must have 3 dimensions \[batch, seqlen, channels\]; got shape \[5, 3\]",
        ),
        (
            {"weight": torch.zeros(2, 4)},
            r"weight must have shape \[channels, kernel_width\] = \[3, >=1\].*got \[2, 4\]",
        ),
        ({"weight": torch.zeros(3, 0)}, r"weight must have shape .* got \[3, 0\]"),
        ({"weight": torch.zeros(3, 1, 4)}, r"weight must have shape .* got \[3, 1, 4\]"),
        ({"bias": torch.zeros(4)}, r"bias must have shape \[channels\] = \[3\].*got \[4\]"),
        ({"activation": "relu"}, r"activation must be one of \['silu', None\]; got 'relu'"),
        (
            {"initial_state": torch.zeros(2, 3, 4)},
            r"initial_state must have shape .* = \[2, 3, 3\]; got \[2, 3, 4\]",
        ),
    ],
)
def test_causal_conv1d_rejects_bad_inputs(bad, message):
    with pytest.raises(ValueError, match=message):
        causal_conv1d(**{**CONV_GOOD, **bad})


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"x_t": torch.zeros(2, 1, 3)}, r"x_t must have 2 dimensions \[batch, channels\]"),
        (
            {"conv_state": torch.zeros(2, 3, 2)},
            r"conv_state must have shape .* = \[2, 3, 3\]; got \[2, 3, 2\]",
        ),
        ({"weight": torch.zeros(4, 4)}, r"weight must have shape .* to match x_t of shape \[2, 3\]"),
        ({"activation": "gelu"}, r"activation must be one of"),
    ],
)
def test_causal_conv1d_step_rejects_bad_inputs(bad, message):
    good = {"conv_state": torch.zeros(2, 3, 3), "x_t": torch.zeros(2, 3), "weight": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match=message):
        causal_conv1d_step(**{**good, **bad})


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"z": torch.zeros(2, 7)}, r"z must have the shape of x.*got x \[2, 8\] and z \[2, 7\]"),
        ({"x": torch.tensor(1.0), "z": torch.tensor(1.0)}, r"x at least one dimension"),
        ({"weight": torch.ones(4)}, r"weight must have shape \[channels\] = \[8\].*got \[4\]"),
        ({"group_size": 3}, r"group_size \(3\) must be >= 1 and divide the number of channels \(8\)"),
        ({"group_size": 0}, r"group_size \(0\) must be >= 1"),
    ],
)
def test_gated_rms_norm_rejects_bad_inputs(bad, message):
    good = {"x": torch.zeros(2, 8), "z": torch.zeros(2, 8), "weight": torch.ones(8), "group_size": 4}
    with pytest.raises(ValueError, match=message):
        gated_rms_norm(**{**good, **bad}, eps=1e-5)
