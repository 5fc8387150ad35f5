"""mcore's fused transformer ops: each a Triton kernel used on CUDA and a PyTorch reference that runs
everywhere else and is the kernel's numerical oracle (``dispatch`` picks one). Today: RMSNorm and
LayerNorm with an optional fused residual add; rotary position embedding (half-split or interleaved,
partial rotary) with its cos/sin tables, YaRN's included; MLP activations (SwiGLU, GeGLU,
quick-GeGLU, GPT-OSS's clamped SwiGLU, quick-GELU, squared ReLU), each optionally weighted per token;
attention softmax with scale, causal mask, sliding window and sinks; MoE top-k routing (softmax or
sigmoid scores, expert bias, renormalisation) per-expert counts padded to an alignment, and token permute/unpermute by a row map; the paged KV-cache append and attention over a paged
KV cache for decode rows and prefill chunks (decode with a C++ CPU kernel built at first use); each
row's greedy token (``argmax_rows``, in the logits' own dtype); one decode token of Mamba-2's
selective state space on a batch of cached state slots, in place (``mamba_state_update``, a C++
CPU kernel); the C++ CPU kernels of RMSNorm, rotary, SwiGLU and paged decode attention called without checks or
autograd, for inference loops (``rms_norm_rows``, ``rotary_rows``, ``swiglu_rows``,
``paged_decode_attention_rows``); cross
entropy, of given logits or fused with the output layer over chunks of tokens, optionally over a
vocabulary split across ranks. Importing this package never imports Triton nor
compiles anything."""

from importlib.metadata import version as _version

from mcore_kernels.activations import (
    clamped_swiglu,
    geglu,
    quick_geglu,
    quick_gelu,
    squared_relu,
    swiglu,
)
from mcore_kernels.argmax_rows import argmax_rows
from mcore_kernels.cross_entropy_linear import linear_cross_entropy
from mcore_kernels.cross_entropy_logits import cross_entropy
from mcore_kernels.dispatch import KernelBackendError, select_backend, use_backend
from mcore_kernels.mamba_state import mamba_state_update
from mcore_kernels.moe_padding import moe_padded_counts
from mcore_kernels.moe_permute import moe_permute, moe_unpermute
from mcore_kernels.moe_routing import moe_topk_routing
from mcore_kernels.native_rows import (
    native_rows_available,
    paged_decode_attention_rows,
    rms_norm_rows,
    rotary_rows,
    swiglu_rows,
)
from mcore_kernels.norm import layer_norm, rms_norm
from mcore_kernels.paged_attention import paged_attention, paged_decode_attention
from mcore_kernels.paged_kv_append import paged_kv_append
from mcore_kernels.rope import apply_rotary, rope_cos_sin, rope_inverse_frequencies
from mcore_kernels.softmax import attention_softmax
from mcore_kernels.yarn import (
    yarn_correction_range,
    yarn_cos_sin,
    yarn_inverse_frequencies,
    yarn_mscale,
)

__version__ = _version("mcore-kernels")

__all__ = [
    "KernelBackendError",
    "__version__",
    "apply_rotary",
    "argmax_rows",
    "attention_softmax",
    "clamped_swiglu",
    "cross_entropy",
    "geglu",
    "layer_norm",
    "linear_cross_entropy",
    "mamba_state_update",
    "moe_padded_counts",
    "moe_permute",
    "moe_topk_routing",
    "moe_unpermute",
    "native_rows_available",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_attention_rows",
    "paged_kv_append",
    "quick_geglu",
    "quick_gelu",
    "rms_norm",
    "rms_norm_rows",
    "rope_cos_sin",
    "rope_inverse_frequencies",
    "rotary_rows",
    "select_backend",
    "squared_relu",
    "swiglu",
    "swiglu_rows",
    "use_backend",
    "yarn_correction_range",
    "yarn_cos_sin",
    "yarn_inverse_frequencies",
    "yarn_mscale",
]
