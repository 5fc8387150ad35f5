"""Inference-only CPU weight packing of the linear layers: the same values as ``F.linear``, taken only
by calls autograd does not record, and never stale after the weight changes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    cpu_weight_packing_available,
    set_cpu_weight_packing,
)
from mcore_parallel.tensor_parallel.packed_weight import padded_rows

pytestmark = pytest.mark.skipif(
    not cpu_weight_packing_available(), reason="this CPU or torch build has no oneDNN bfloat16 matmul"
)


def _layers(dtype=torch.bfloat16):
    group = dist.group.WORLD
    column = ColumnParallelLinear(40, 72, tp_group=group, params_dtype=dtype)
    row = RowParallelLinear(72, 24, tp_group=group, params_dtype=dtype)
    with torch.no_grad():
        column.bias.normal_()
        row.bias.normal_()
    return torch.nn.Sequential(column, row), column, row


def _expected(column, row, x):
    hidden = F.linear(x, column.weight, column.bias)
    return hidden, F.linear(hidden, row.weight) + row.bias


def _packed_values_equal_f_linear():
    torch.manual_seed(0)
    model, column, row = _layers()
    assert set_cpu_weight_packing(model, True) == 2
    # 65, 102 and 300 rows run padded (to 68, 104 and 304): the padding rows are dropped
    for shape in [(1, 40), (3, 5, 40), (0, 40), (37, 40), (65, 40), (2, 51, 40), (300, 1, 40)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                hidden, _ = column(x)
                output, _ = row(hidden)
                expected_hidden, expected_output = _expected(column, row, x)
            assert torch.equal(hidden, expected_hidden) and torch.equal(output, expected_output)
    assert column.packed_weight._packed is not None and row.packed_weight._packed is not None
    # inputs that are not contiguous (a transposed view, every other row), unpadded and padded
    for x in (torch.randn(40, 6, dtype=torch.bfloat16).t(), torch.randn(140, 40, dtype=torch.bfloat16)[::2]):
        with torch.no_grad():
            hidden, _ = column(x)
        assert torch.equal(hidden, _expected(column, row, x)[0])


def test_packed_values_equal_f_linear(run_distributed):
    run_distributed(_packed_values_equal_f_linear, 1)


def _recorded_calls_and_other_dtypes_take_f_linear():
    torch.manual_seed(0)
    model, column, _ = _layers()
    set_cpu_weight_packing(model, True)
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    hidden, _ = column(x)  # grad mode, weight requires grad: the graph is recorded
    hidden.float().sum().backward()
    assert column.packed_weight._packed is None and column.weight.grad is not None
    model32, column32, _ = _layers(torch.float32)
    set_cpu_weight_packing(model32, True)
    with torch.no_grad():
        out32, _ = column32(x.float())
    assert column32.packed_weight._packed is None
    assert torch.equal(out32, F.linear(x.float(), column32.weight, column32.bias))


def test_recorded_calls_and_other_dtypes_take_f_linear(run_distributed):
    run_distributed(_recorded_calls_and_other_dtypes_take_f_linear, 1)


def _changed_weights_are_repacked():
    torch.manual_seed(0)
    model, column, row = _layers()
    set_cpu_weight_packing(model, True)
    x = torch.randn(6, 40, dtype=torch.bfloat16)

    def check():
        with torch.inference_mode():
            hidden, _ = column(x)
            output, _ = row(hidden)
        assert torch.equal(output, _expected(column, row, x)[1])

    check()
    with torch.no_grad():  # an optimizer step
        column.weight.mul_(-2)
    check()
    row.weight.data = torch.randn_like(row.weight)  # a swapped storage
    check()
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    check()
    column.weight = torch.nn.Parameter(torch.randn_like(column.weight))  # a new parameter object
    check()


def test_changed_weights_are_repacked(run_distributed):
    run_distributed(_changed_weights_are_repacked, 1)


def _turning_packing_off_drops_the_copies():
    model, column, row = _layers()
    set_cpu_weight_packing(model, True)
    assert set_cpu_weight_packing(model, False) == 0
    assert column.packed_weight is None and row.packed_weight is None


def test_turning_packing_off_drops_the_copies(run_distributed):
    run_distributed(_turning_packing_off_drops_the_copies, 1)


def _compiled_calls_take_f_linear():
    torch.manual_seed(0)
    model, column, row = _layers()
    set_cpu_weight_packing(model, True)
    compiled = torch.compile(lambda x: row(column(x)[0])[0], fullgraph=True)
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        output = compiled(x)
        _, expected = _expected(column, row, x)
    # inductor may round the bf16 intermediate differently from eager (torch 2.6: 8e-5 on an
    # element that is 0 eagerly), hence an absolute tolerance of bf16's scale here
    torch.testing.assert_close(output, expected, atol=1e-3, rtol=1.6e-2)
    assert column.packed_weight._packed is None  # traced calls never packed


def test_compiled_calls_take_f_linear(run_distributed):
    """``torch.compile`` over packing layers traces ``F.linear`` (a packed copy made while tracing
    fails to lower: "weight must be a graph constant") and gives F.linear's values."""
    run_distributed(_compiled_calls_take_f_linear, 1)


def test_padded_row_counts():
    """Decode-sized calls run exact; above 64 rows, 16 sizes per doubling, under 1/16 more rows."""
    assert [padded_rows(n) for n in (0, 1, 63, 64)] == [0, 1, 63, 64]
    assert [padded_rows(n) for n in (65, 68, 69, 128, 129, 257, 493, 512, 513)] == [
        68, 68, 72, 128, 136, 272, 496, 512, 544,
    ]  # fmt: skip
    sizes = [padded_rows(n) for n in range(1, 4097)]
    assert all(n <= p < n * 17 / 16 for n, p in enumerate(sizes, 1))
    assert sizes == sorted(sizes) and len(set(sizes)) == 64 + 6 * 16


def _warm_up_packs_every_layer_and_keeps_the_values():
    torch.manual_seed(0)
    model, column, row = _layers()
    assert set_cpu_weight_packing(model, True, warm_up_rows=100) == 2
    assert column.packed_weight._packed is not None and row.packed_weight._packed is not None
    x = torch.randn(70, 40, dtype=torch.bfloat16)
    with torch.inference_mode():
        output, _ = row(column(x)[0])
    assert torch.equal(output, _expected(column, row, x)[1])
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="warm_up_rows must be an int >= 0"):
            set_cpu_weight_packing(model, True, warm_up_rows=bad)
    assert set_cpu_weight_packing(model, False, warm_up_rows=100) == 0 and column.packed_weight is None


def test_warm_up_packs_every_layer_and_keeps_the_values(run_distributed):
    run_distributed(_warm_up_packs_every_layer_and_keeps_the_values, 1)
