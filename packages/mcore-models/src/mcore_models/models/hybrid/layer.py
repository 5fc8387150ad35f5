"""One hybrid layer: ``x + mixer(norm(x))``, the mixer picked by the layer's symbol in the pattern."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig
from ...transformer.inference_context import InferenceContext
from ...transformer.layer import TransformerLayer
from ...transformer.spec import build_module
from .inference import mamba_inference_forward
from .layer_pattern import HybridLayerPattern


@experimental_api
@dataclass
class HybridLayerSubmodules:
    """Specs of a hybrid layer's parts: the pre-norm and one mixer spec per layer type (``mamba``
    for ``M``, ``attention`` for ``*``, ``mlp`` for ``-``, ``moe`` for ``E``)."""

    norm: Any = None
    mamba: Any = None
    attention: Any = None
    mlp: Any = None
    moe: Any = None


@experimental_api
class HybridLayer(torch.nn.Module):
    """Pre-norm residual layer on ``[s, b, h]`` whose mixer is the one ``pattern`` names for
    ``layer_number`` (1-based, global): a Mamba mixer, self-attention, an MLP or an MoE layer.
    Called like ``TransformerLayer``, so ``TransformerBlock`` stacks it. ``layer_type`` is
    ``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"``.

    Raises:
        ValueError: ``layer_number`` lies outside the pattern.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridLayerSubmodules,
        layer_number: int,
        *,
        pattern: HybridLayerPattern,
        tp_group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if not 1 <= layer_number <= pattern.num_layers:
            raise ValueError(
                f"layer_number ({layer_number}) must be in [1, {pattern.num_layers}] for the hybrid "
                f"pattern {pattern.symbols!r}"
            )
        self.config = config
        self.layer_number = layer_number
        self.layer_type = pattern.layer_types()[layer_number - 1]
        self.tp_group = tp_group
        self.norm = build_module(submodules.norm, config, config.hidden_size)
        spec = getattr(submodules, self.layer_type)
        if self.layer_type == "mamba":
            self.mixer = build_module(spec, config, tp_group=tp_group, layer_number=layer_number)
        elif self.layer_type == "attention":
            self.mixer = build_module(
                spec, config, layer_number=layer_number, tp_group=tp_group, cp_group=cp_group
            )
        else:
            self.mixer = build_module(spec, config, tp_group=tp_group)
        self.hidden_dropout = torch.nn.Dropout(config.hidden_dropout)
        if config.sequence_parallel:
            for p in self.norm.parameters():
                p.sequence_parallel = True

    _dropout = TransformerLayer._dropout  # the same residual dropout (same attributes)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``; the attention arguments go to an attention mixer only.
        With ``inference_context`` (an engine step, see ``InferenceContext``) a Mamba mixer
        continues each request's state in the context (``mamba_inference_forward``).

        Raises:
            NotImplementedError: a Mamba layer is given packed sequences (``segment_ids``) or an
                ``attention_mask``.
            TypeError: a Mamba layer is given an ``inference_context`` that keeps no Mamba states.
        """
        normed = self.norm(hidden_states)
        if self.layer_type == "attention":
            output = self.mixer(
                normed, rotary, segment_ids, attention_mask, inference_context=inference_context
            )
        elif self.layer_type == "mamba" and inference_context is not None:
            output = mamba_inference_forward(self.mixer, normed, inference_context)
        else:
            if self.layer_type == "mamba" and (segment_ids is not None or attention_mask is not None):
                raise NotImplementedError(
                    "Mamba layers scan the whole sequence: packed sequences (restarting position_ids, "
                    "packed_seq_params) and attention_mask are not supported"
                )
            output = self.mixer(normed)
        return hidden_states + self._dropout(output)
