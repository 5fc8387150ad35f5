"""The ops the models run with hand-written backwards (the PyTorch references of mcore-kernels' RoPE,
RMSNorm and SwiGLU, forced with ``use_backend``: on the CPU ``auto`` runs their C++ kernels, which
mcore-kernels' tests hold to these references) and the fused attention's batch-in-heads layout
against autograd of the plain formulas: bit for bit in float32 (RMSNorm also in bfloat16), plus
``gradcheck`` in float64 where the computation is in float64."""

import pytest
import torch
import torch.nn.functional as F
from mcore_kernels import apply_rotary, use_backend
from mcore_models import TransformerConfig
from mcore_models.transformer.activations import activation_function
from mcore_models.transformer.norm import RMSNorm
from mcore_testing.peers import rms_norm_rounds_once


def _assert_same_values_and_grads(fn, reference, leaves, grad):
    """``fn()`` on the kernels' references and ``reference()`` give equal tensors and equal
    gradients for ``leaves``."""
    with use_backend("reference"):
        out = fn()
    ref = reference()
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    grads, ref_grads = torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad)
    for g, ref_g in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, ref_g)


def _plain_rotary(x, cos, sin):
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


def _tables(s, b, d):
    angles = torch.rand(s, b, 1, d // 2) * 10
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def test_rotary_matches_the_plain_formula_bit_for_bit():
    torch.manual_seed(0)
    cos, sin = _tables(7, 3, 16)
    base = torch.randn(14, 3, 5, 16, requires_grad=True)
    x = base[::2]  # non-contiguous, as q and k views are
    _assert_same_values_and_grads(
        lambda: apply_rotary(x, cos, sin),
        lambda: _plain_rotary(x, cos, sin),
        [base],
        torch.randn(7, 3, 5, 16),
    )


def test_rotary_of_bfloat16_is_computed_in_float32():
    torch.manual_seed(0)
    cos, sin = _tables(6, 2, 8)
    x = torch.randn(6, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _plain_rotary(x, cos, sin))
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    (float_grad,) = torch.autograd.grad(apply_rotary(x.float(), cos, sin), x, torch.ones_like(out).float())
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, float_grad.bfloat16())


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not rms_norm_rounds_once(),
                reason=f"the peer, F.rms_norm of torch {torch.__version__}, rounds bfloat16 twice "
                "(the normalized input, then the product with the weight); RMSNorm rounds once, "
                "as torch's fused rms_norm does",
            ),
        ),
    ],
)
def test_rms_norm_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    base = torch.randn(5, 2, 3, 3, 16, dtype=dtype, requires_grad=True)
    x = base[:, :, :, 1]  # non-contiguous, as qk-norm inputs are
    _assert_same_values_and_grads(
        lambda: norm(x),
        lambda: F.rms_norm(x, (16,), norm.weight, 1e-5),
        [base, norm.weight],
        torch.randn(5, 2, 3, 16, dtype=dtype),
    )


def test_rms_norm_has_the_exact_gradient():
    norm = RMSNorm(8, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


def test_swiglu_matches_the_plain_formula_bit_for_bit():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, activation="swiglu")
    swiglu = activation_function(config)
    x = torch.randn(5, 2, 12, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    _assert_same_values_and_grads(lambda: swiglu(x), lambda: F.silu(gate) * up, [x], torch.randn(5, 2, 6))
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x,))


def test_fused_attention_folds_the_batch_into_heads(run_distributed, model_parallel):
    """SDPA on ``[1, b * n, s, d]`` views (GQA by ``enable_gqa``) equals the explicit softmax path."""

    def body():
        from mcore_models import DotProductAttention

        groups = model_parallel(1)
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
        )
        attention = DotProductAttention(config, 1, tp_group=groups.tp)
        torch.manual_seed(0)
        s, b, d = 9, 3, 8
        mixed = torch.randn(s, b, 2, 4, d, requires_grad=True)  # per group [q, q, k, v], as split_qkv sees it
        query, key, value = mixed.split([2, 1, 1], dim=3)
        query, key, value = query.reshape(s, b, 4, d), key.squeeze(3), value.squeeze(3)
        fused = attention(query, key, value)
        explicit = attention(query, key, value, attention_mask=torch.zeros(b, 1, s, s, dtype=torch.bool))
        grad = torch.randn(s, b, 4 * d)
        (fused_grad,) = torch.autograd.grad(fused, mixed, grad)
        (explicit_grad,) = torch.autograd.grad(explicit, mixed, grad)
        # float32 rounding of two summation orders (1.01e-6 seen on an Intel Xeon)
        torch.testing.assert_close(fused, explicit, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_grad, explicit_grad, rtol=1e-6, atol=1e-6)

    run_distributed(body, 1)
