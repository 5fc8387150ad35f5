"""``GroupedExperts``' two forms: the CPU grouped matmul (``torch._grouped_mm``, where torch has
it) against the zero-padded batched matmul, outputs and gradients, with an expert that gets no
rows, biases, per-row probabilities, a zero-stride output gradient and bfloat16; and the fallback
for rows that ``torch._grouped_mm`` cannot take."""

import pytest
import torch
from mcore_models.transformer.moe import GroupedExperts
from mcore_models.transformer.moe.grouped_experts import grouped_mm_runs
from mcore_testing.moe_reference import moe_config

needs_grouped_mm = pytest.mark.skipif(
    not grouped_mm_runs(torch.float32),
    reason=f"torch {torch.__version__} has no CPU grouped matmul (torch._grouped_mm): only the padded form runs",
)


def _experts(bias: bool, weighted: bool, hidden: int = 16) -> GroupedExperts:
    torch.manual_seed(0)
    config = moe_config(
        hidden_size=hidden, add_bias_linear=bias, moe_weighted_activation=weighted, moe_ffn_hidden_size=8
    )
    experts = GroupedExperts(config, num_local_experts=4)
    if bias:
        with torch.no_grad():
            experts.bias1.normal_()
            experts.bias2.normal_()
    return experts


def _run(experts, form, rows, counts, probs, loss):
    rows = rows.clone().requires_grad_()
    probs = None if probs is None else probs.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = getattr(experts, form)(rows, counts, probs)
    loss(out).backward()
    grads = [rows.grad] + [p.grad for p in experts.parameters()]
    return [out.detach(), *grads, None if probs is None else probs.grad]


@needs_grouped_mm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_the_padded_batch(bias, weighted, dtype):
    experts = _experts(bias, weighted).to(dtype)
    counts = [5, 0, 9, 2]  # expert 1 gets no rows
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(sum(counts), 16, generator=gen).to(dtype)
    probs = torch.rand(sum(counts), generator=gen).to(dtype) if weighted else None
    weights = torch.randn(sum(counts), 16, generator=gen).to(dtype)
    for loss in (lambda out: (out * weights).sum(), lambda out: out.sum()):  # the second: zero strides
        grouped = _run(experts, "_grouped", rows, counts, probs, loss)
        padded = _run(experts, "_padded", rows, counts, probs, loss)
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for a, b in zip(grouped, padded, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, **tolerance)


@needs_grouped_mm
def test_forward_takes_the_grouped_matmul_on_aligned_rows_and_pads_the_others(monkeypatch):
    taken = []
    for hidden, form in ((16, "_grouped"), (6, "_padded")):  # 6 float32s: 24-byte rows
        experts = _experts(False, False, hidden)
        monkeypatch.setattr(experts, form, lambda *args, form=form: taken.append(form))
        experts(torch.randn(3, hidden), [1, 0, 2, 0])
    assert taken == ["_grouped", "_padded"]


@needs_grouped_mm
def test_the_probe_answers_alike_when_first_asked_under_no_grad():
    grouped_mm_runs.cache_clear()
    try:
        with torch.no_grad():  # as a model's first forward in inference asks it
            assert grouped_mm_runs(torch.float32)
    finally:
        grouped_mm_runs.cache_clear()


@needs_grouped_mm
@pytest.mark.parametrize("layout", ["column slice", "offset start"])
def test_rows_that_are_views_of_a_wider_or_shifted_buffer_are_packed_first(layout):
    """The dispatcher may hand over rows with a 17-float stride, or starting mid-buffer."""
    experts = _experts(True, False)
    counts = [3, 4, 0, 2]
    wide = torch.randn(sum(counts) + 1, 17, generator=torch.Generator().manual_seed(2))
    rows = (
        wide[:-1, :16] if layout == "column slice" else wide.flatten()[1 : 1 + 16 * sum(counts)].view(-1, 16)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            experts._grouped(rows, counts, None), experts._padded(rows.contiguous(), counts, None)
        )
