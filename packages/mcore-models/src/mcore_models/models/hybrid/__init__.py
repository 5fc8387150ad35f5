"""Hybrid models that mix Mamba, attention, MLP and MoE layers: the layer-pattern string that says
which layer goes where (``HybridLayerPattern``), the layer and its spec (``HybridLayer``,
``get_hybrid_layer_spec``), the model (``HybridModel``) and the import of Hugging Face NemotronH
and Mamba2 checkpoints (``import_nemotron_h``, ``import_mamba2``) and their export
(``export_nemotron_h``, ``export_mamba2``), and Bamba's (``import_bamba``, ``export_bamba``)."""

from .bamba import (
    bamba_configs,
    bamba_hf_config,
    bamba_pattern,
    bamba_state,
    bamba_weights,
    export_bamba,
    import_bamba,
)
from .layer import HybridLayer, HybridLayerSubmodules
from .layer_pattern import LAYER_SYMBOLS, STAGE_SEPARATOR, HybridLayerPattern
from .mamba2 import export_mamba2, import_mamba2, mamba2_configs, mamba2_hf_config
from .model import HybridModel
from .nemotron_h import import_nemotron_h, nemotron_h_configs, nemotron_h_pattern, nemotron_h_state
from .nemotron_h_export import export_nemotron_h, nemotron_h_hf_config, nemotron_h_weights
from .specs import get_hybrid_layer_spec

__all__ = [
    "LAYER_SYMBOLS",
    "STAGE_SEPARATOR",
    "HybridLayer",
    "HybridLayerPattern",
    "HybridLayerSubmodules",
    "HybridModel",
    "bamba_configs",
    "bamba_hf_config",
    "bamba_pattern",
    "bamba_state",
    "bamba_weights",
    "export_bamba",
    "export_mamba2",
    "export_nemotron_h",
    "get_hybrid_layer_spec",
    "import_bamba",
    "import_mamba2",
    "import_nemotron_h",
    "mamba2_configs",
    "mamba2_hf_config",
    "nemotron_h_configs",
    "nemotron_h_hf_config",
    "nemotron_h_pattern",
    "nemotron_h_state",
    "nemotron_h_weights",
]
