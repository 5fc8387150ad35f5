"""The chunked SSD scan against the per-timestep recurrence, and the recurrence against hand values."""

import math

import pytest
import torch
from mcore_models.ssm import ssd_chunked_scan, ssd_naive_recurrence
from mcore_models.ssm.ssd_scan import segment_sum

EXACT = {"rtol": 0.0, "atol": 1e-10}


def _split(inputs, with_skip, with_initial_state):
    """The positional SSD inputs, and the optional ones as keyword arguments."""
    positional = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    optional = {
        "D": inputs["D"] if with_skip else None,
        "initial_state": inputs["initial_state"] if with_initial_state else None,
    }
    return positional, optional


def test_recurrence_matches_hand_computed_values():
    # one head, headdim 1, dstate 1; dt = 2 and A = -ln(2)/2 make every decay exactly 1/2
    x = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 2, 1, 1)
    dt = torch.full((1, 2, 1), 2.0, dtype=torch.float64)
    A = torch.tensor([-math.log(2.0) / 2], dtype=torch.float64)
    B = torch.tensor([1.0, 3.0], dtype=torch.float64).view(1, 2, 1, 1)
    C = torch.tensor([2.0, 1.0], dtype=torch.float64).view(1, 2, 1, 1)
    D = torch.tensor([0.5], dtype=torch.float64)
    # h1 = 0.5*0 + 2*1*1 = 2, y1 = 2*2 + 0.5*1 = 4.5; h2 = 0.5*2 + 2*2*3 = 13, y2 = 13*1 + 0.5*2 = 14
    y, state = ssd_naive_recurrence(x, dt, A, B, C, D=D, return_final_state=True)
    torch.testing.assert_close(y.flatten(), torch.tensor([4.5, 14.0], dtype=torch.float64), **EXACT)
    torch.testing.assert_close(state.flatten(), torch.tensor([13.0], dtype=torch.float64), **EXACT)
    # from h0 = 4: h1 = 2 + 2 = 4, y1 = 8.5; h2 = 2 + 12 = 14, y2 = 15
    initial = torch.full((1, 1, 1, 1), 4.0, dtype=torch.float64)
    y, state = ssd_naive_recurrence(x, dt, A, B, C, D=D, initial_state=initial, return_final_state=True)
    torch.testing.assert_close(y.flatten(), torch.tensor([8.5, 15.0], dtype=torch.float64), **EXACT)
    torch.testing.assert_close(state.flatten(), torch.tensor([14.0], dtype=torch.float64), **EXACT)


def test_recurrence_state_is_x_outer_b():
    # one step from a zero state, headdim 2, dstate 3: the state is dt * x ⊗ B, [headdim, dstate]
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64).view(1, 1, 1, 2)
    B = torch.tensor([3.0, 0.0, 5.0], dtype=torch.float64).view(1, 1, 1, 3)
    C = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64).view(1, 1, 1, 3)
    dt = torch.full((1, 1, 1), 0.5, dtype=torch.float64)
    A = torch.tensor([-1.0], dtype=torch.float64)
    y, state = ssd_naive_recurrence(x, dt, A, B, C, return_final_state=True)
    expected_state = 0.5 * torch.tensor([[3.0, 0.0, 5.0], [-6.0, 0.0, -10.0]], dtype=torch.float64)
    torch.testing.assert_close(state.view(2, 3), expected_state, **EXACT)
    torch.testing.assert_close(y.flatten(), torch.tensor([6.5, -13.0], dtype=torch.float64), **EXACT)


def test_segment_sum_hand_computed():
    log_decay = torch.tensor([-1.0, -2.0, -4.0], dtype=torch.float64)
    inf = float("-inf")
    expected = torch.tensor([[0.0, inf, inf], [-2.0, 0.0, inf], [-6.0, -4.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(segment_sum(log_decay), expected, **EXACT)


@pytest.mark.parametrize("seqlen", [1, 7, 16, 33])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize(
    ("with_skip", "with_initial_state"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_chunked_scan_matches_recurrence(
    ssd_inputs, seqlen, chunk_size, ngroups, with_skip, with_initial_state
):
    inputs = ssd_inputs(seqlen=seqlen, nheads=4, ngroups=ngroups, seed=seqlen * 100 + chunk_size)
    positional, optional = _split(inputs, with_skip, with_initial_state)
    y, state = ssd_chunked_scan(*positional, chunk_size=chunk_size, **optional, return_final_state=True)
    y_ref, state_ref = ssd_naive_recurrence(*positional, **optional, return_final_state=True)
    assert y.shape == inputs["x"].shape and y.dtype == torch.float64
    assert state.shape == inputs["initial_state"].shape
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(state, state_ref, **EXACT)
    assert torch.equal(ssd_chunked_scan(*positional, chunk_size=chunk_size, **optional), y)


def test_heads_read_their_own_group(ssd_inputs):
    # nheads 4, ngroups 2: heads 0-1 read group 0, heads 2-3 read group 1
    inputs = ssd_inputs(seqlen=9, nheads=4, ngroups=2)
    perturbed = dict(inputs)
    for name in ("B", "C"):
        perturbed[name] = inputs[name].clone()
        perturbed[name][:, :, 1] += 1.0
    for run in (
        lambda i: ssd_chunked_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=4),
        lambda i: ssd_naive_recurrence(i["x"], i["dt"], i["A"], i["B"], i["C"]),
    ):
        before, after = run(inputs), run(perturbed)
        assert torch.equal(before[:, :, :2], after[:, :, :2])
        assert not torch.allclose(before[:, :, 2:], after[:, :, 2:])


@pytest.mark.parametrize("split_at", [1, 5, 8, 12])
def test_two_calls_carrying_the_state_equal_one_call(ssd_inputs, split_at):
    inputs = ssd_inputs(seqlen=13, ngroups=2)
    x, dt, B, C = (inputs[name] for name in ("x", "dt", "B", "C"))
    A, D = inputs["A"], inputs["D"]
    common = {"chunk_size": 4, "D": D, "return_final_state": True}
    y_full, state_full = ssd_chunked_scan(x, dt, A, B, C, initial_state=inputs["initial_state"], **common)
    y_first, state_mid = ssd_chunked_scan(
        x[:, :split_at],
        dt[:, :split_at],
        A,
        B[:, :split_at],
        C[:, :split_at],
        initial_state=inputs["initial_state"],
        **common,
    )
    y_second, state_end = ssd_chunked_scan(
        x[:, split_at:],
        dt[:, split_at:],
        A,
        B[:, split_at:],
        C[:, split_at:],
        initial_state=state_mid,
        **common,
    )
    torch.testing.assert_close(torch.cat([y_first, y_second], dim=1), y_full, **EXACT)
    torch.testing.assert_close(state_end, state_full, **EXACT)


@pytest.mark.parametrize("split_at", [3, 9])
def test_chunked_scan_continues_the_recurrence_from_its_state(ssd_inputs, split_at):
    """A prefill chunk of the inference engine: the chunked scan started from the state the naive
    recurrence left after the first tokens equals the recurrence over the whole sequence."""
    inputs = ssd_inputs(seqlen=13, ngroups=2)
    x, dt, A, B, C, D = (inputs[name] for name in ("x", "dt", "A", "B", "C", "D"))
    y_full, state_full = ssd_naive_recurrence(x, dt, A, B, C, D=D, return_final_state=True)
    _, state_mid = ssd_naive_recurrence(
        *(t[:, :split_at] for t in (x, dt)),
        A,
        *(t[:, :split_at] for t in (B, C)),
        D=D,
        return_final_state=True,
    )
    y_rest, state_end = ssd_chunked_scan(
        *(t[:, split_at:] for t in (x, dt)),
        A,
        *(t[:, split_at:] for t in (B, C)),
        chunk_size=4,
        D=D,
        initial_state=state_mid,
        return_final_state=True,
    )
    torch.testing.assert_close(y_rest, y_full[:, split_at:], **EXACT)
    torch.testing.assert_close(state_end, state_full, **EXACT)


def test_gradients_match_recurrence(ssd_inputs):
    inputs = ssd_inputs(seqlen=11, nheads=4, ngroups=2, dstate=3)
    leaves = {name: value.clone().requires_grad_(True) for name, value in inputs.items()}
    names = ("x", "dt", "A", "B", "C")
    kwargs = {"D": leaves["D"], "initial_state": leaves["initial_state"], "return_final_state": True}
    cotangents = torch.Generator().manual_seed(1)
    y_grad = torch.randn(inputs["x"].shape, generator=cotangents, dtype=torch.float64)
    state_grad = torch.randn(inputs["initial_state"].shape, generator=cotangents, dtype=torch.float64)

    def grads(run):
        y, state = run(*(leaves[name] for name in names), **kwargs)
        loss = (y * y_grad).sum() + (state * state_grad).sum()
        return torch.autograd.grad(loss, list(leaves.values()))

    chunked = grads(lambda *args, **kw: ssd_chunked_scan(*args, chunk_size=4, **kw))
    reference = grads(ssd_naive_recurrence)
    for name, got, want in zip(leaves, chunked, reference, strict=True):
        torch.testing.assert_close(
            got, want, rtol=0.0, atol=1e-10, msg=lambda m, name=name: f"d/d{name}: {m}"
        )


def test_chunked_scan_passes_gradcheck(ssd_inputs):
    inputs = ssd_inputs(batch=1, seqlen=5, nheads=2, headdim=2, ngroups=1, dstate=2)
    leaves = [inputs[name].clone().requires_grad_(True) for name in ("x", "dt", "A", "B", "C", "D")]

    def run(x, dt, A, B, C, D):
        return ssd_chunked_scan(x, dt, A, B, C, D=D, chunk_size=2, return_final_state=True)

    assert torch.autograd.gradcheck(run, leaves)


def test_strong_decay_stays_finite_and_exact(ssd_inputs):
    # decays of exp(-800) per step underflow to zero; no inf - inf, no NaN in values or gradients
    inputs = ssd_inputs(seqlen=24, nheads=4, ngroups=2)
    dt = (inputs["dt"] * 40.0).requires_grad_(True)
    A = (inputs["A"] * 5.0).requires_grad_(True)
    x, B, C = inputs["x"], inputs["B"], inputs["C"]
    y, state = ssd_chunked_scan(
        x.float(), dt.float(), A.float(), B.float(), C.float(), chunk_size=16, return_final_state=True
    )
    y_ref, state_ref = ssd_naive_recurrence(x, dt, A, B, C, return_final_state=True)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-4, atol=1e-4)
    dt_grad, A_grad = torch.autograd.grad(y.sum() + state.sum(), [dt, A])
    assert torch.isfinite(dt_grad).all() and torch.isfinite(A_grad).all()


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 2e-2)]
)
def test_low_precision_inputs_are_close_to_float64_oracle(ssd_inputs, dtype, rtol, atol):
    inputs = ssd_inputs(seqlen=37, nheads=4, ngroups=2, dtype=dtype)
    positional, optional = _split(inputs, with_skip=True, with_initial_state=True)
    y, state = ssd_chunked_scan(*positional, chunk_size=16, **optional, return_final_state=True)
    as_float64 = [t.double() for t in positional]
    y_ref, state_ref = ssd_naive_recurrence(
        *as_float64,
        D=optional["D"].double(),
        initial_state=optional["initial_state"].double(),
        return_final_state=True,
    )
    assert y.dtype == dtype
    assert state.dtype == torch.float32
    scale = y_ref.abs().max()
    torch.testing.assert_close(y.double(), y_ref, rtol=rtol, atol=atol * scale)
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-5 * state_ref.abs().max())
