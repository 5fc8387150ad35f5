"""The float32 layout of CPU weight packing (``set_cpu_weight_packing(..., layout="float32")``, what
``"auto"`` takes where oneDNN has no bfloat16 matmul): 16-bit weights kept widened to float32, the
product computed in float32 and rounded once to the input's dtype. Runs on every CPU."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import ColumnParallelLinear, RowParallelLinear, set_cpu_weight_packing
from mcore_parallel.tensor_parallel import packed_weight
from mcore_parallel.tensor_parallel.packed_weight import PackedLinearWeight

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing of the dtype's values


def _layers(dtype):
    group = dist.group.WORLD
    column = ColumnParallelLinear(40, 72, tp_group=group, params_dtype=dtype)
    row = RowParallelLinear(72, 24, tp_group=group, params_dtype=dtype)
    with torch.no_grad():
        column.bias.normal_()
        row.bias.normal_()
    return torch.nn.Sequential(column, row), column, row


@torch.no_grad()
def _within_one_rounding(actual, x, weight, bias):
    """``actual`` is the exact (float64) product rounded to its dtype: at most one unit of the
    dtype's last place away from it, and the 16-bit ``F.linear`` of the same operands is too."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    tolerance = ULP[actual.dtype] * exact.abs() + 1e-6
    assert ((actual.double() - exact).abs() <= tolerance).all()
    reference = F.linear(x, weight, bias).double()
    assert ((reference - exact).abs() <= tolerance).all()


def _float32_layout_values(dtype):
    torch.manual_seed(0)
    model, column, row = _layers(dtype)
    assert set_cpu_weight_packing(model, True, layout="float32") == 2
    for shape in [(1, 40), (3, 5, 40), (0, 40), (65, 40), (2, 51, 40)]:
        x = torch.randn(shape, dtype=dtype)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                hidden, _ = column(x)
                output, _ = row(hidden)
                product = row.packed_weight.linear(hidden, row.weight, None)
            assert hidden.dtype == dtype and hidden.shape == (*shape[:-1], 72)
            _within_one_rounding(hidden, x, column.weight, column.bias)
            _within_one_rounding(product, hidden, row.weight, None)
            assert torch.equal(output, product + row.bias)  # the row layer adds its bias after the reduction
    for layer in (column, row):
        assert layer.packed_weight._packed.dtype == torch.float32
        assert torch.equal(layer.packed_weight._packed, layer.weight.float())
    x = torch.randn(40, 6, dtype=dtype).t()  # not contiguous
    with torch.no_grad():
        _within_one_rounding(column(x)[0], x, column.weight, column.bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_layout_rounds_the_exact_product_once(run_distributed, dtype):
    run_distributed(_float32_layout_values, 1, dtype)


def _recorded_calls_and_float32_weights_take_f_linear():
    torch.manual_seed(1)
    model, column, _ = _layers(torch.bfloat16)
    set_cpu_weight_packing(model, True, layout="float32")
    x = torch.randn(9, 40, dtype=torch.bfloat16)
    hidden, _ = column(x)  # autograd records it: F.linear on the bfloat16 weight itself
    assert hidden.requires_grad and torch.equal(hidden, F.linear(x, column.weight, column.bias))
    assert column.packed_weight._packed is None
    wide, wide_column, _ = _layers(torch.float32)
    set_cpu_weight_packing(wide, True, layout="float32")
    with torch.no_grad():
        x = torch.randn(9, 40)
        assert torch.equal(wide_column(x)[0], F.linear(x, wide_column.weight, wide_column.bias))
    assert wide_column.packed_weight._packed is None


def test_recorded_calls_and_float32_weights_take_f_linear(run_distributed):
    run_distributed(_recorded_calls_and_float32_weights_take_f_linear, 1)


def _changed_weights_are_widened_again():
    torch.manual_seed(2)
    model, column, _ = _layers(torch.bfloat16)
    set_cpu_weight_packing(model, True, layout="float32", warm_up_rows=16)
    assert torch.equal(column.packed_weight._packed, column.weight.float())  # made by the warm-up
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        column.weight.copy_(torch.randn_like(column.weight))  # the version counter sees it
        _within_one_rounding(column(x)[0], x, column.weight, column.bias)
    assert torch.equal(column.packed_weight._packed, column.weight.float())


def test_changed_weights_are_widened_again(run_distributed):
    run_distributed(_changed_weights_are_widened_again, 1)


def _auto_layout_follows_onednn(available):
    model, column, _ = _layers(torch.bfloat16)
    packed_weight.cpu_weight_packing_available = lambda: available
    set_cpu_weight_packing(model, True)
    assert column.packed_weight.layout == ("onednn" if available else "float32")
    if not available:
        with pytest.raises(RuntimeError, match="no oneDNN bfloat16 matmul"):
            set_cpu_weight_packing(model, True, layout="onednn")
    with pytest.raises(ValueError, match="layout must be 'auto', 'onednn' or 'float32', got 'fp32'"):
        set_cpu_weight_packing(model, True, layout="fp32")
    with pytest.raises(ValueError, match="layout must be 'onednn' or 'float32'"):
        PackedLinearWeight("auto")


@pytest.mark.parametrize("available", [True, False])
def test_auto_layout_is_onednn_where_it_has_bf16_else_float32(run_distributed, available):
    run_distributed(_auto_layout_follows_onednn, 1, available)
