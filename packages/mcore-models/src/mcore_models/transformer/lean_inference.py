"""A plain transformer layer's inference forward with the fewest Python calls.

A decode step of a small model is mostly fixed cost: every layer runs a dozen ops, each behind
module calls, argument checks, backend dispatch and autograd wrappers that cost more than the op
itself at a few rows (and the cores idle meanwhile). For the common layer (RMSNorm, self-attention
without query/key norms, a SwiGLU MLP, no biases, one tensor-parallel rank) on the C++ CPU
kernels, ``lean_inference_forward`` computes the same ops on the step's rows directly: the norms,
the rotary embedding of queries and keys (one call for both), and SwiGLU through mcore-kernels'
unchecked row kernels, the linears through their modules, the attention through the layer's
``attend_cached``. The kernels are those of the generic path, so the results are the same bits.
"""

from __future__ import annotations

import mcore_kernels
import torch
from mcore_parallel import ColumnParallelLinear, RowParallelLinear

from .attention import SelfAttention
from .core_attention import DotProductAttention
from .inference_context import InferenceContext
from .mlp import MLP
from .norm import RMSNorm

LEAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lean_inference_supported(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s modules are all ones ``lean_inference_forward`` computes exactly (its
    structure only: whether a given call may take it is ``lean_inference_applies``). Checked at
    every call (a few microseconds): modules swapped after the first step are seen."""
    attention, mlp, config = layer.self_attention, layer.mlp, layer.config
    return (
        type(layer.input_layernorm) is RMSNorm
        and type(layer.pre_mlp_layernorm) is RMSNorm
        and type(attention) is SelfAttention
        and attention.q_layernorm is None
        and attention.k_layernorm is None
        and type(attention.core_attention) is DotProductAttention
        and attention.core_attention.cp_group is None
        and type(mlp) is MLP
        and config.gated_linear_unit
        and config.activation == "swiglu"
        and not config.glu_linear_offset
        and config.activation_clamp_value is None
        and not config.add_bias_linear
        and not config.sequence_parallel
        and all(
            type(linear) in (ColumnParallelLinear, RowParallelLinear) and linear.bias is None
            for linear in (attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
        )
        and layer._single_tp_rank
        and mcore_kernels.native_rows_available()
    )


def lean_inference_applies(hidden_states: torch.Tensor, rotary) -> bool:
    """Whether this call (of a supported layer) may take the lean path: CPU rows in a kernel dtype,
    autograd off, the native kernels the selected backend, rotary tables shared by all heads."""
    return (
        not torch.is_grad_enabled()
        and hidden_states.device.type == "cpu"
        and hidden_states.dtype in LEAN_DTYPES
        and rotary is not None
        and rotary[0].dim() == 4
        and rotary[0].shape[2] == 1
        and mcore_kernels.select_backend("rms_norm", hidden_states, kernels=("triton", "native")) == "native"
    )


def _eps(norm: RMSNorm, dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def lean_inference_forward(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    inference_context: InferenceContext,
) -> torch.Tensor:
    """``layer(hidden_states [s, b, h], rotary, inference_context=...)`` computed on its ``s * b``
    rows (see the module doc)."""
    s, b, hidden = hidden_states.shape
    rows = hidden_states.reshape(s * b, hidden).contiguous()
    attention, mlp = layer.self_attention, layer.mlp
    normed = mcore_kernels.rms_norm_rows(
        rows, layer.input_layernorm.weight, _eps(layer.input_layernorm, rows.dtype)
    )
    mixed, _ = attention.linear_qkv(normed)
    query, key, value = _split_and_rotate(attention, mixed, rotary)
    context = attention.core_attention.attend_cached(query, key, value, inference_context)
    projected, _ = attention.linear_proj(context)
    rows = rows + projected
    normed = mcore_kernels.rms_norm_rows(
        rows, layer.pre_mlp_layernorm.weight, _eps(layer.pre_mlp_layernorm, rows.dtype)
    )
    intermediate, _ = mlp.linear_fc1(normed)
    output, _ = mlp.linear_fc2(mcore_kernels.swiglu_rows(intermediate.contiguous()))
    return (rows + output).view(s, b, hidden)


def _split_and_rotate(
    attention: SelfAttention, mixed: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``split_qkv`` of ``mixed [t, (n + 2g) d]`` into ``query [t, n, d]``, ``key, value [t, g, d]``,
    the queries and keys rotated by one kernel call (their heads lie side by side in each group)."""
    tokens = mixed.shape[0]
    per_group, dim = attention.num_heads // attention.num_groups, attention.head_dim
    grouped = attention.grouped_qkv(mixed)
    cos, sin = rotary
    rotated = mcore_kernels.rotary_rows(
        grouped[:, :, : per_group + 1].reshape(-1, dim), cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    ).view(tokens, attention.num_groups, per_group + 1, dim)
    query = rotated[:, :, :per_group].reshape(tokens, attention.num_heads, dim)
    return query, rotated[:, :, per_group], grouped[:, :, per_group + 1]
