"""Sliding-window layouts between HF ``layer_types`` and ``window_size``/``window_attn_skip_freq``."""

from __future__ import annotations

from typing import Any

from ..config.transformer_config import TransformerConfig


def window_from_layer_types(layer_types: list[str] | None, sliding_window: int | None) -> dict[str, Any]:
    """Config keyword arguments for per-layer ``"sliding_attention"``/``"full_attention"`` types."""
    if sliding_window is None or not layer_types or "sliding_attention" not in layer_types:
        return {"window_size": None, "window_attn_skip_freq": None}
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise NotImplementedError(f"Hugging Face layer_types {sorted(unknown)} are not supported")
    pattern = [int(t == "sliding_attention") for t in layer_types]
    return {"window_size": int(sliding_window), "window_attn_skip_freq": None if all(pattern) else pattern}


def layer_types_of(config: TransformerConfig) -> list[str]:
    """HF ``layer_types`` for the config's window pattern."""
    return [
        "sliding_attention" if config.is_window_attention_layer(n) else "full_attention"
        for n in range(1, config.num_layers + 1)
    ]


class LayerTypeWindows:
    """Mapping mixin for families with ``use_sliding_window``, ``sliding_window``, ``layer_types``
    (or, in older configs, ``max_window_layers``: the layers from that index on use the window)."""

    def window_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        if not hf.get("use_sliding_window", False):
            return window_from_layer_types(None, None)
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", hf["num_hidden_layers"])
            layer_types = [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
        return window_from_layer_types(layer_types, hf.get("sliding_window"))

    def window_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        if config.window_size is None:
            return {"use_sliding_window": False, "sliding_window": None}
        return {
            "use_sliding_window": True,
            "sliding_window": config.window_size,
            "layer_types": layer_types_of(config),
        }
