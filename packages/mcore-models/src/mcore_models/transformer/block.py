"""A stack of transformer layers with optional final norm and full activation recompute."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import checkpoint

from ..config.transformer_config import TransformerConfig
from .inference_context import InferenceContext
from .norm import build_norm
from .recompute_phase import recomputable
from .spec import ModuleSpec, build_module


class TransformerBlock(torch.nn.Module):
    """Layers ``first_layer_number .. first_layer_number + num_layers - 1`` (1-based, global)
    built from ``layer_spec``, then the final norm when ``post_process``.

    With ``recompute_granularity="full"`` (training only), ``recompute_method="uniform"``
    checkpoints consecutive groups of ``recompute_num_layers`` layers, ``"block"`` checkpoints
    each of the first ``recompute_num_layers`` layers. ``cp_group`` goes to every layer's attention
    (context parallelism).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_spec: ModuleSpec,
        *,
        tp_group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None = None,
        num_layers: int | None = None,
        first_layer_number: int = 1,
        post_process: bool = True,
        final_norm_spec: ModuleSpec | None = None,
    ):
        super().__init__()
        self.config = config
        num_layers = config.num_layers if num_layers is None else num_layers
        self.layers = torch.nn.ModuleList(
            build_module(
                layer_spec, config, layer_number=first_layer_number + i, tp_group=tp_group, cp_group=cp_group
            )
            for i in range(num_layers)
        )
        self.final_layernorm = (
            build_module(final_norm_spec or build_norm, config, config.hidden_size) if post_process else None
        )
        if self.final_layernorm is not None and config.sequence_parallel:
            for p in self.final_layernorm.parameters():
                p.sequence_parallel = True
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states received from the previous pipeline stage, used when the model has no embedding."""
        self.input_tensor = tensor

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, rotary_cos, rotary_sin, segment_ids, attention_mask):
            rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, rotary, segment_ids, attention_mask)
            return hidden_states

        return run

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        if hidden_states is None:
            hidden_states = self.input_tensor
        cos, sin = rotary if rotary is not None else (None, None)
        context = (cos, sin, segment_ids, attention_mask)
        config, count = self.config, len(self.layers)
        if inference_context is not None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, rotary, inference_context=inference_context)
        elif config.recompute_granularity == "full" and self.training:
            step = config.recompute_num_layers
            if config.recompute_method == "uniform":
                for start in range(0, count, step):
                    run = recomputable(self._run_layers(start, start + step))
                    hidden_states = checkpoint(run, hidden_states, *context)
            else:
                for index in range(count):
                    run = self._run_layers(index, index + 1)
                    hidden_states = (
                        checkpoint(recomputable(run), hidden_states, *context)
                        if index < step
                        else run(hidden_states, *context)
                    )
        else:
            hidden_states = self._run_layers(0, count)(hidden_states, *context)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
