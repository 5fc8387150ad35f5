"""``HybridModel``: a ``GPTModel`` whose layers mix Mamba, attention, MLP and MoE by a pattern."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from ...config.transformer_config import TransformerConfig
from ...ssm import MambaConfig
from ...transformer.inference_model import MambaInferenceStateConfig
from ...transformer.moe.expert_group import with_expert_parallel_group
from ...transformer.process_groups import resolve_process_groups
from ...transformer.spec import ModuleSpec
from ..gpt.model import GPTModel
from .inference import mamba_state_config
from .layer_pattern import HybridLayerPattern
from .specs import get_hybrid_layer_spec


@experimental_api
class HybridModel(GPTModel):
    """A decoder-only language model whose layer ``i`` is the ``HybridLayer`` that ``pattern``
    (a ``HybridLayerPattern`` or its string, e.g. ``"M*-E"``) names: pre-norm + Mamba mixer,
    self-attention, MLP or MoE layer, + residual. Embedding, final norm, output layer, loss,
    tensor and pipeline parallelism and the ``forward`` contract for training are ``GPTModel``'s.

    ``layer_spec`` defaults to ``get_hybrid_layer_spec(config, pattern, mamba)``; ``mamba``
    (default ``MambaConfig()``) configures only that default. Pipeline stages hold consecutive
    layers (``pattern.stage_layers``): the pattern's ``|`` stages, which may differ in size, else
    equal shares. ``inference_forward`` (of ``InferenceModel``) takes a ``MambaInferenceContext``,
    which keeps each request's Mamba state (``mamba_state_config``). Not supported yet: context
    parallelism; Mamba layers reject packed sequences and ``attention_mask``.

    Raises:
        ConfigError: see ``HybridLayerPattern.check_model``.
        NotImplementedError: context parallelism.
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
        pattern.check_model(config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("hybrid models do not support context parallelism yet")
        if mamba is not None and layer_spec is not None:
            raise ValueError("give mamba or layer_spec, not both: mamba configures the default layer spec")
        groups = resolve_process_groups(pg_collection)
        pp_size = dist.get_world_size(groups.pp) if groups.pp is not None else 1
        pp_rank = dist.get_rank(groups.pp) if groups.pp is not None else 0
        stages = pattern.stage_layers(pp_size * (config.virtual_pipeline_model_parallel_size or 1))
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
            stage_layers=stages[(vp_stage or 0) * pp_size + pp_rank],
        )
        self.pattern = pattern

    @property
    def mamba_state_config(self) -> MambaInferenceStateConfig | None:
        """The per-request Mamba state this stage's layers keep in an inference engine (``None``
        without Mamba layers here); the optional member of ``InferenceModel``."""
        return mamba_state_config(self.decoder.layers)
