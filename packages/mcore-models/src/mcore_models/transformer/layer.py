"""One pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config.transformer_config import TransformerConfig
from .inference_context import InferenceContext
from .lean_inference import lean_inference_applies, lean_inference_forward, lean_inference_supported
from .rng import tensor_parallel_rng
from .spec import build_module


@dataclass
class TransformerLayerSubmodules:
    """Specs of a layer's parts."""

    input_layernorm: Any = None
    self_attention: Any = None
    pre_mlp_layernorm: Any = None
    mlp: Any = None


class TransformerLayer(torch.nn.Module):
    """Pre-norm residual layer on ``[s, b, h]``. ``layer_number`` is 1-based and global (it picks
    the layer's attention window). With sequence parallelism the norms see this rank's slice of the
    sequence, so their parameters are tagged ``sequence_parallel = True``. ``cp_group`` goes to the
    attention (context parallelism)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int,
        *,
        tp_group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.tp_group = tp_group
        self._single_tp_rank = dist.get_world_size(tp_group) == 1  # a group's size never changes
        self.input_layernorm = build_module(submodules.input_layernorm, config, config.hidden_size)
        self.self_attention = build_module(
            submodules.self_attention, config, layer_number=layer_number, tp_group=tp_group, cp_group=cp_group
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, config.hidden_size)
        self.mlp = build_module(submodules.mlp, config, tp_group=tp_group)
        self.hidden_dropout = torch.nn.Dropout(config.hidden_dropout)
        if config.sequence_parallel:
            for norm in (self.input_layernorm, self.pre_mlp_layernorm):
                for p in norm.parameters():
                    p.sequence_parallel = True

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.hidden_dropout.p > 0):
            return x
        if self.config.sequence_parallel:  # each rank holds different tokens: draw different masks
            with tensor_parallel_rng(self.tp_group):
                return self.hidden_dropout(x)
        return self.hidden_dropout(x)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        if (
            inference_context is not None
            and not self.training
            and lean_inference_applies(hidden_states, rotary)
            and lean_inference_supported(self)
        ):
            return lean_inference_forward(self, hidden_states, rotary, inference_context)
        attention = self.self_attention(
            self.input_layernorm(hidden_states),
            rotary,
            segment_ids,
            attention_mask,
            inference_context=inference_context,
        )
        hidden_states = hidden_states + self._dropout(attention)
        return hidden_states + self._dropout(self.mlp(self.pre_mlp_layernorm(hidden_states)))
