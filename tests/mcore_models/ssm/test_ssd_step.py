"""Token-by-token decoding with ssd_decode_step against the chunked scan over the same sequence."""

import pytest
import torch
from mcore_models.ssm import ssd_chunked_scan, ssd_decode_step


def _decode(state, inputs, with_skip):
    outputs = []
    for t in range(inputs["x"].shape[1]):
        y_t, state = ssd_decode_step(
            state,
            inputs["x"][:, t],
            inputs["dt"][:, t],
            inputs["A"],
            inputs["B"][:, t],
            inputs["C"][:, t],
            inputs["D"] if with_skip else None,
        )
        outputs.append(y_t)
    return torch.stack(outputs, dim=1), state


@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("with_skip", [False, True])
def test_decoding_token_by_token_matches_chunked_scan(ssd_inputs, ngroups, with_skip):
    inputs = ssd_inputs(seqlen=9, nheads=4, ngroups=ngroups)
    y_scan, state_scan = ssd_chunked_scan(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        chunk_size=4,
        D=inputs["D"] if with_skip else None,
        initial_state=inputs["initial_state"],
        return_final_state=True,
    )
    y_steps, state_steps = _decode(inputs["initial_state"], inputs, with_skip)
    torch.testing.assert_close(y_steps, y_scan, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(state_steps, state_scan, rtol=0.0, atol=1e-10)


def test_decoding_continues_a_prefilled_state(ssd_inputs):
    inputs = ssd_inputs(seqlen=10, nheads=4, ngroups=2)
    prompt = {
        name: (v[:, :6] if v.dim() >= 3 and name != "initial_state" else v) for name, v in inputs.items()
    }
    rest = {name: (v[:, 6:] if v.dim() >= 3 and name != "initial_state" else v) for name, v in inputs.items()}
    args = ("x", "dt", "A", "B", "C")
    y_full = ssd_chunked_scan(*(inputs[n] for n in args), chunk_size=4, D=inputs["D"])
    y_prompt, state = ssd_chunked_scan(
        *(prompt[n] for n in args), chunk_size=4, D=inputs["D"], return_final_state=True
    )
    y_rest, _ = _decode(state, rest, with_skip=True)
    torch.testing.assert_close(torch.cat([y_prompt, y_rest], dim=1), y_full, rtol=0.0, atol=1e-10)


def test_step_leaves_state_alone_and_keeps_dtypes(ssd_inputs):
    inputs = ssd_inputs(seqlen=1, nheads=4, ngroups=2, dtype=torch.bfloat16)
    state = inputs["initial_state"].float()
    before = state.clone()
    y, new_state = ssd_decode_step(
        state,
        inputs["x"][:, 0],
        inputs["dt"][:, 0],
        inputs["A"],
        inputs["B"][:, 0],
        inputs["C"][:, 0],
        inputs["D"],
    )
    assert torch.equal(state, before)
    assert y.dtype == torch.bfloat16 and y.shape == inputs["x"][:, 0].shape
    assert new_state.dtype == torch.float32 and new_state.shape == state.shape
    assert not torch.equal(new_state, state)
