"""The functional core of Mamba-2, as plain differentiable PyTorch functions that run on CPU: the
chunked state-space-duality scan (``ssd_chunked_scan``) with its per-timestep reference recurrence
(``ssd_naive_recurrence``) and single-token decode step (``ssd_decode_step``), the depthwise causal
convolution with its decode step (``causal_conv1d``, ``causal_conv1d_step``), and the gated
RMSNorm (``gated_rms_norm``). The Mamba-2 mixer layer built from them, hybrid Mamba/attention
models, Hugging Face checkpoint parity and serving are planned, not yet built."""

from .causal_conv1d import causal_conv1d, causal_conv1d_step
from .gated_rms_norm import gated_rms_norm
from .ssd_reference import ssd_naive_recurrence
from .ssd_scan import ssd_chunked_scan
from .ssd_step import ssd_decode_step

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_rms_norm",
    "ssd_chunked_scan",
    "ssd_decode_step",
    "ssd_naive_recurrence",
]
