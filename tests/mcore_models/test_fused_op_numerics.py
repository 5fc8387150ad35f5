"""The models' numbers on the CPU, guarded across their switch to mcore-kernels' norms, activations
and rotary embedding: logits and every parameter's gradient of tiny ``GPTModel`` forwards and
backwards (float32 and bfloat16; RMSNorm and LayerNorm, SwiGLU, GeGLU with a clamp, quick-GeGLU with
an offset, squared ReLU, RoPE and YaRN, qk-norm, sinks, windows, MoE with weighted activations)
against recorded values.

The recording was first made with the models' own PyTorch code, then remade after the switch. In
float32 every value stayed bit for bit except qk-norm's weight gradients (a few float32 ulps: the
reduction over ``[s, b, heads]`` rows now runs over contiguous rows instead of the query view's
layout). In bfloat16, the gated activations and weighted squared ReLU are now computed in float32
and rounded once, where the models rounded each bfloat16 step; RMSNorm, RoPE, YaRN and plain squared
ReLU stayed bit for bit.

The recorded numbers are the PyTorch references' (``MCORE_KERNELS_BACKEND=reference``), compared
bit for bit where torch, the CPU's instruction set and its vendor are the recording's (CPU matmuls
round differently across each: an Intel Xeon misses the AMD EPYC recording by float32 ulps).
Elsewhere float32 is compared within 1e-5, and bfloat16 is skipped: at torch 2.6 its CPU ops round
differently enough that MoE routing flips on near-ties and gradients move by more than any
tolerance would hide. The C++ CPU kernels that ``auto`` picks since (RMSNorm, SwiGLU and RoPE,
forward and backward) agree with the references to float32 rounding, not bit for bit: the float32
cases are also run on ``auto`` and compared within 1e-5.
Regenerate with ``python tests/mcore_models/test_fused_op_numerics.py`` only on purpose.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from mcore_kernels import use_backend

GOLDEN = Path(__file__).parent / "golden" / "fused_op_numerics.pt"
VOCAB = 32
VARIANTS = {
    "rmsnorm-swiglu-rope-qknorm-sinks-window": dict(
        normalization="RMSNorm",
        activation="swiglu",
        num_query_groups=2,
        qk_layernorm=True,
        softmax_type="learnable",
        position_embedding_type="rope",
        add_bias_linear=False,
        window_size=3,
        window_attn_skip_freq=[1, 0],
    ),
    "layernorm-quick-geglu-offset": dict(
        softmax_type="off-by-one", activation="quick_geglu", glu_linear_offset=1.0
    ),
    "yarn-squared-relu": dict(
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, activation="squared_relu"
    ),
    "rmsnorm-geglu-clamp-llama3-rope": dict(
        normalization="RMSNorm",
        activation="geglu",
        activation_clamp_value=0.5,
        position_embedding_type="rope",
        rope_scaling_type="llama3",
        rope_scaling_factor=8.0,
    ),
    "moe-weighted-clamped-quick-geglu-yarn": dict(
        normalization="RMSNorm",
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_clamp_value=0.7,
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=8,
        yarn_correction_range_round_to_int=False,
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        moe_weighted_activation=True,
        add_bias_linear=False,
    ),
    "moe-swiglu-shared-expert": dict(
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=12,
    ),
}
CASES = [(variant, dtype) for variant in VARIANTS for dtype in ("float32", "bfloat16")]


def forward_backward(variant: str, dtype_name: str, backend: str = "reference") -> dict[str, object]:
    """Logits and parameter gradients (as float32 numpy arrays: exact for bfloat16) of one
    forward and backward of a seeded two-layer model on kernel ``backend``; runs inside a rank."""
    with use_backend(backend):
        return _forward_backward(variant, dtype_name)


def _forward_backward(variant: str, dtype_name: str) -> dict[str, object]:
    from mcore_models import GPTModel, TransformerConfig
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    destroy_model_parallel()
    groups = initialize_model_parallel(tensor_model_parallel_size=1)
    dtype = getattr(torch, dtype_name)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=24,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        **VARIANTS[variant],
    )
    torch.manual_seed(0)
    model = GPTModel(config, VOCAB, pg_collection=groups).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 11), generator=generator)
    model.parallel_output = False
    logits = model(ids)
    logits.backward(torch.randn(logits.shape, generator=generator).to(logits.dtype))
    result = {"logits": logits.detach().float().numpy()}
    for name, p in model.named_parameters():
        result[f"grad:{name}"] = p.grad.float().numpy()
    return result


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_vendor": _cpu_vendor(),
    }


@pytest.mark.parametrize(("variant", "dtype"), CASES, ids=[f"{v}-{d}" for v, d in CASES])
def test_model_numbers_match_the_recording(variant, dtype, run_distributed):
    golden = torch.load(GOLDEN, weights_only=False)
    # The recording predates the vendor key; it was made on an AMD EPYC.
    exact = {"cpu_vendor": "AuthenticAMD", **golden["environment"]} == _environment()
    if dtype == "bfloat16" and not exact:
        pytest.skip(
            f"bf16 numbers are recorded with {golden['environment']}; bf16 CPU ops of other torch releases or CPUs "
            "round differently (and MoE routing flips on near-ties), so they are no oracle here"
        )
    (result,) = run_distributed(forward_backward, 1, variant, dtype, timeout=60)
    expected = golden["cases"][f"{variant}-{dtype}"]
    assert sorted(result) == sorted(expected)
    for key, array in result.items():
        actual, recorded = torch.from_numpy(array), torch.from_numpy(expected[key])
        if exact:
            assert torch.equal(actual, recorded), f"{variant}-{dtype} {key} moved"
        else:
            torch.testing.assert_close(actual, recorded, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_kernels_keep_the_recorded_float32_numbers_to_rounding(variant, run_distributed):
    """The default (``auto``) backend, the C++ kernels on this CPU, against the references' recording."""
    expected = torch.load(GOLDEN, weights_only=False)["cases"][f"{variant}-float32"]
    (result,) = run_distributed(forward_backward, 1, variant, "float32", "auto", timeout=60)
    assert sorted(result) == sorted(expected)
    for key, array in result.items():
        torch.testing.assert_close(
            torch.from_numpy(array), torch.from_numpy(expected[key]), rtol=1e-5, atol=1e-5, msg=key
        )


def _record() -> None:
    from mcore_testing.distributed import run_distributed

    cases = {}
    for variant, dtype in CASES:
        (cases[f"{variant}-{dtype}"],) = run_distributed(forward_backward, 1, variant, dtype, timeout=120)
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save({"environment": _environment(), "cases": cases}, GOLDEN)


if __name__ == "__main__":
    _record()
