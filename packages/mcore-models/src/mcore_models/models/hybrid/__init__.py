"""Hybrid models that mix Mamba, attention, MLP and MoE layers. Today: the layer-pattern string
that says which layer goes where (``HybridLayerPattern``); the hybrid model built from it is
planned."""

from .layer_pattern import LAYER_SYMBOLS, STAGE_SEPARATOR, HybridLayerPattern

__all__ = ["LAYER_SYMBOLS", "STAGE_SEPARATOR", "HybridLayerPattern"]
