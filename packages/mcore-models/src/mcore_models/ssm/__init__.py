"""The functional core of Mamba-2, as plain differentiable PyTorch functions that run on CPU: the
chunked state-space-duality scan (``ssd_chunked_scan``) with its per-timestep reference recurrence
(``ssd_naive_recurrence``) and single-token decode step (``ssd_decode_step``), the depthwise causal
convolution with its decode step (``causal_conv1d``, ``causal_conv1d_step``), and the gated
RMSNorm (``gated_rms_norm``); and the tensor-parallel Mamba-2 mixer layer built from them
(``MambaMixer``, configured by ``MambaConfig``, with its parts ``CausalConv1dLayer`` and ``GatedRMSNormLayer`` and the blockwise
sharding of its stacked projections, ``blockwise_shard``/``blockwise_unshard``). The hybrid
models built from the mixer are in ``mcore_models.models.hybrid``."""

from .block_sharding import blockwise_shard, blockwise_unshard
from .causal_conv1d import causal_conv1d, causal_conv1d_step
from .causal_conv1d_layer import CausalConv1dLayer
from .gated_rms_norm import gated_rms_norm
from .gated_rms_norm_layer import GatedRMSNormLayer
from .mamba_config import MambaConfig
from .mamba_mixer import MambaMixer
from .ssd_reference import ssd_naive_recurrence
from .ssd_scan import ssd_chunked_scan
from .ssd_step import ssd_decode_step

__all__ = [
    "CausalConv1dLayer",
    "GatedRMSNormLayer",
    "MambaConfig",
    "MambaMixer",
    "blockwise_shard",
    "blockwise_unshard",
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_rms_norm",
    "ssd_chunked_scan",
    "ssd_decode_step",
    "ssd_naive_recurrence",
]
