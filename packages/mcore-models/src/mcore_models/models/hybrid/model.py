"""``HybridModel``: a ``GPTModel`` whose layers mix Mamba, attention, MLP and MoE by a pattern."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import ConfigError, ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...ssm import MambaConfig
from ...transformer.inference_context import InferenceContext
from ...transformer.moe.expert_group import with_expert_parallel_group
from ...transformer.packed_seq import PackedSeqParams
from ...transformer.process_groups import resolve_process_groups
from ...transformer.spec import ModuleSpec
from ..gpt.model import GPTModel
from .layer_pattern import HybridLayerPattern
from .specs import get_hybrid_layer_spec


@experimental_api
class HybridModel(GPTModel):
    """A decoder-only language model whose layer ``i`` is the ``HybridLayer`` that ``pattern``
    (a ``HybridLayerPattern`` or its string, e.g. ``"M*-E"``) names: pre-norm + Mamba mixer,
    self-attention, MLP or MoE layer, + residual. Embedding, final norm, output layer, loss,
    tensor and pipeline parallelism and the ``forward`` contract for training are ``GPTModel``'s.

    ``layer_spec`` defaults to ``get_hybrid_layer_spec(config, pattern, mamba)``; ``mamba``
    (default ``MambaConfig()``) configures only that default. Pipeline stages hold equal numbers
    of consecutive layers (``pattern.stage_layers``); a pattern with ``|`` must place its splits
    there. Not supported yet: context parallelism and ``inference_forward`` / ``inference_context``;
    Mamba layers reject packed sequences and ``attention_mask``.

    Raises:
        ConfigError: ``config.num_layers`` differs from the pattern's layer count, the pattern has
            MoE layers but ``config.num_moe_experts`` is unset, or its ``|`` stages do not match
            the pipeline (and virtual pipeline) stages.
        NotImplementedError: uneven pipeline stages, or context parallelism.
        ValueError: ``mamba`` given together with ``layer_spec``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pattern: HybridLayerPattern | str,
        mamba: MambaConfig | None = None,
        layer_spec: ModuleSpec | None = None,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        parallel_output: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
    ):
        pattern = pattern if isinstance(pattern, HybridLayerPattern) else HybridLayerPattern.parse(pattern)
        if config.num_layers != pattern.num_layers:
            raise ConfigError(
                ["num_layers", "hybrid_layer_pattern"],
                f"config.num_layers ({config.num_layers}) differs from the {pattern.num_layers} layers "
                f"of the pattern {pattern.symbols!r}",
            )
        if "E" in pattern.symbols and config.num_moe_experts is None:
            raise ConfigError(
                ["num_moe_experts", "hybrid_layer_pattern"],
                "the pattern has MoE layers ('E'); set num_moe_experts",
            )
        if config.context_parallel_size > 1:
            raise NotImplementedError("hybrid models do not support context parallelism yet")
        if mamba is not None and layer_spec is not None:
            raise ValueError("give mamba or layer_spec, not both: mamba configures the default layer spec")
        groups = resolve_process_groups(pg_collection)
        pp_size = dist.get_world_size(groups.pp) if groups.pp is not None else 1
        stages = pattern.stage_layers(pp_size * (config.virtual_pipeline_model_parallel_size or 1))
        if len({len(stage) for stage in stages}) > 1:
            raise NotImplementedError(
                f"pipeline stages of unequal sizes {[len(s) for s in stages]} are not supported yet; "
                "place the '|' splits every num_layers / stages layers"
            )
        if layer_spec is None:
            layer_spec = get_hybrid_layer_spec(config, pattern, mamba)
        super().__init__(
            config,
            vocab_size,
            with_expert_parallel_group(layer_spec, groups.ep, groups.expert_tp, field="moe"),
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=parallel_output,
            pg_collection=groups,
            vp_stage=vp_stage,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
        )
        self.pattern = pattern

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``GPTModel.forward`` for training and evaluation; ``inference_context`` is not supported yet."""
        if inference_context is not None:
            raise NotImplementedError("hybrid models do not support inference_context yet")
        return super().forward(input_ids, position_ids, attention_mask, labels, packed_seq_params)

    def inference_forward(self, *args, **kwargs) -> torch.Tensor:
        """Not supported yet (Mamba layers have no decode state in the inference context)."""
        raise NotImplementedError("hybrid models do not support inference_forward yet")
