"""``GPTModel``: embedding -> transformer block -> final norm -> output layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from mcore_kernels import linear_cross_entropy
from mcore_parallel import (
    ColumnParallelLinear,
    ProcessGroupCollection,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

from ...config.transformer_config import TransformerConfig
from ...transformer.block import TransformerBlock
from ...transformer.context_parallel import context_parallel_positions
from ...transformer.inference_context import InferenceContext
from ...transformer.inference_model import KVCacheSpec
from ...transformer.init import init_method
from ...transformer.moe.expert_group import with_expert_parallel_group
from ...transformer.packed_seq import PackedSeqParams, segments_from_position_ids
from ...transformer.process_groups import resolve_process_groups
from ...transformer.rope import RotaryEmbedding
from ...transformer.spec import ModuleSpec
from ...transformer.specs import get_gpt_layer_spec
from ...transformer.yarn import YarnRotaryEmbedding
from .embedding import LanguageModelEmbedding
from .special_tokens import token_id, token_ids


class GPTModel(torch.nn.Module):
    """A decoder-only language model.

    MoE layers of the layer spec take their expert-parallel and expert-tensor-parallel groups from
    ``pg_collection.ep`` and ``pg_collection.expert_tp`` when they are set. ``pre_process`` (first pipeline stage) adds the embedding, ``post_process`` (last stage) the
    final norm and output layer; a stage without the embedding takes its input through
    ``set_input_tensor``. Layers of this stage are split evenly over the pipeline group of
    ``pg_collection`` (or the global groups), unless ``stage_layers`` gives this (virtual) stage's
    global 0-based layer indices (stages may then differ in size). ``forward`` returns logits
    ``[b, s, padded_vocab_size / tp]`` (exactly the ``vocab_size`` ids when
    ``parallel_output=False``), per-token losses ``[b, s]`` when ``labels`` are given, or the
    hidden states ``[s, b, h]`` on a stage without ``post_process``.

    The embedding and output layer have ``padded_vocab_size`` rows
    (``config.padded_vocab_size(vocab_size)``: a multiple of the TP size times
    ``config.make_vocab_size_divisible_by``). The padded ids are never predicted: their logits are
    ``-inf`` in a vocab-parallel shard (so the loss ignores them) and are cut off from the full
    logits, which always have exactly ``vocab_size`` columns.

    With ``config.virtual_pipeline_model_parallel_size`` ``v``, a stage holds ``v`` chunks and
    ``vp_stage`` says which one this is: chunk ``c`` of stage ``s`` holds the layers of virtual
    stage ``c * pp + s`` (the interleaved schedule's order).

    ``bos_token_id``, ``eos_token_ids`` and ``pad_token_id`` are the special token ids the model
    was trained with (Hugging Face import reads them, export writes them); an inference engine
    stops at ``eos_token_ids`` by default. The model implements ``InferenceModel``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
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
        stage_layers: range | None = None,
    ):
        super().__init__()
        self.bos_token_id = token_id("bos_token_id", bos_token_id)
        self.eos_token_ids = token_ids("eos_token_ids", eos_token_ids)
        self.pad_token_id = token_id("pad_token_id", pad_token_id)
        groups = resolve_process_groups(pg_collection)
        self.tp_group = groups.tp
        tp_size = dist.get_world_size(self.tp_group)
        if tp_size != config.tensor_model_parallel_size:
            raise ValueError(
                f"config.tensor_model_parallel_size ({config.tensor_model_parallel_size}) differs from "
                f"the size of the tensor-parallel group ({tp_size})"
            )
        self.cp_group = groups.cp if groups.cp is not None and dist.get_world_size(groups.cp) > 1 else None
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size ({config.context_parallel_size}) differs from "
                f"the size of the context-parallel group ({cp_size})"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.padded_vocab_size = config.padded_vocab_size(vocab_size)
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        pp_size = dist.get_world_size(groups.pp) if groups.pp is not None else 1
        pp_rank = dist.get_rank(groups.pp) if groups.pp is not None else 0
        chunks = config.virtual_pipeline_model_parallel_size or 1
        if vp_stage is not None and not 0 <= vp_stage < chunks:
            raise ValueError(f"vp_stage must be in [0, {chunks}), got {vp_stage}")
        if stage_layers is None and config.num_layers % (pp_size * chunks):
            raise ValueError(
                f"num_layers ({config.num_layers}) must divide over {pp_size} pipeline stages x "
                f"{chunks} virtual stages"
            )
        if config.share_embeddings_and_output_weights and not (pre_process and post_process):
            raise NotImplementedError("tied embeddings across pipeline stages are not supported yet")
        if stage_layers is None:
            per_stage = config.num_layers // (pp_size * chunks)
            first = ((vp_stage or 0) * pp_size + pp_rank) * per_stage
            stage_layers = range(first, first + per_stage)

        self.embedding = (
            LanguageModelEmbedding(config, self.padded_vocab_size, tp_group=self.tp_group)
            if pre_process
            else None
        )
        rotary_class = {"rope": RotaryEmbedding, "yarn": YarnRotaryEmbedding}.get(
            config.position_embedding_type
        )
        self.rotary_pos_emb = rotary_class(config) if rotary_class is not None else None
        self.decoder = TransformerBlock(
            config,
            with_expert_parallel_group(
                layer_spec if layer_spec is not None else get_gpt_layer_spec(config),
                groups.ep,
                groups.expert_tp,
            ),
            tp_group=self.tp_group,
            cp_group=self.cp_group,
            num_layers=len(stage_layers),
            first_layer_number=stage_layers.start + 1,
            post_process=post_process,
        )
        self.output_layer = None
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                tp_group=self.tp_group,
                bias=False,
                sequence_parallel=config.sequence_parallel,
                init_method=init_method(config),
                params_dtype=config.params_dtype,
            )
            if config.share_embeddings_and_output_weights:
                self.output_layer.weight = self.embedding.word_embeddings.weight

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states ``[s, b, h]`` from the previous pipeline stage."""
        self.decoder.set_input_tensor(tensor)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states between layers and pipeline stages."""
        return self.config.hidden_size

    @property
    def max_sequence_length(self) -> int | None:
        """``max_position_embeddings`` with learned absolute positions, else ``None`` (no limit)."""
        if self.config.position_embedding_type == "learned_absolute":
            return self.config.max_position_embeddings
        return None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """This stage's layers and this tensor-parallel rank's key/value heads."""
        numbers = [layer.layer_number for layer in self.decoder.layers]
        parameter = next(self.parameters())
        return KVCacheSpec(
            range(numbers[0], numbers[-1] + 1),
            self.config.num_query_groups // dist.get_world_size(self.tp_group),
            self.config.kv_channels,
            parameter.dtype,
            parameter.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """``input_ids [b, s]``; ``position_ids [b, s]`` (restarts mark packed documents);
        ``attention_mask`` boolean ``[b, 1, s, s]``, ``True`` = masked (on top of causal);
        ``packed_seq_params`` for a one-row packed batch; ``labels [b, s]``.

        With context parallelism (``config.context_parallel_size`` > 1) the inputs hold this rank's
        tokens as ``split_batch`` cut them (``position_ids`` default to their true positions), and
        so do the outputs; packed sequences and ``attention_mask`` are not supported then.

        With ``inference_context`` (see ``InferenceContext``) the batch is one flattened row of
        new tokens with their ``position_ids``, attention runs over the context's cache, and the
        logits are those of the rows ``inference_context.logits_indices``."""
        if inference_context is not None:
            return self._inference_forward(
                input_ids, position_ids, inference_context, None, gather=not self.parallel_output
            )
        if self.cp_group is not None:
            return self._context_parallel_forward(
                input_ids, position_ids, attention_mask, labels, packed_seq_params
            )
        batch, seq_length = input_ids.shape
        segment_ids = None
        if packed_seq_params is not None:
            segment_ids = packed_seq_params.segment_ids(seq_length)
            if position_ids is None:
                position_ids = packed_seq_params.position_ids(seq_length)
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=input_ids.device).expand(batch, seq_length)
        elif segment_ids is None:
            segment_ids = segments_from_position_ids(position_ids)
        return self._forward_tokens(input_ids, position_ids, segment_ids, attention_mask, labels)

    def _context_parallel_forward(self, input_ids, position_ids, attention_mask, labels, packed_seq_params):
        """``forward`` on this CP rank's tokens: no packing or extra mask; true positions by default."""
        if packed_seq_params is not None or attention_mask is not None:
            raise ValueError("context parallelism does not support packed sequences or attention_mask")
        if position_ids is None:
            cp_size = dist.get_world_size(self.cp_group)
            positions = context_parallel_positions(
                input_ids.shape[1] * cp_size, dist.get_rank(self.cp_group), cp_size, input_ids.device
            )
            position_ids = positions.expand(input_ids.shape[0], -1)
        return self._forward_tokens(input_ids, position_ids, None, None, labels)

    def _forward_tokens(self, input_ids, position_ids, segment_ids, attention_mask, labels) -> torch.Tensor:
        hidden = self.embedding(input_ids, position_ids) if self.embedding is not None else None
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        hidden = self.decoder(hidden, rotary, segment_ids, attention_mask)
        if not self.post_process:
            return hidden
        if labels is not None and self._fused_loss(hidden):
            return self._linear_cross_entropy(hidden, labels)
        logits = self._exclude_padding(self.output_layer(hidden)[0])  # [s, b, padded v / tp]
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group).t()
        if not self.parallel_output:
            logits = self._gather_vocab(logits)
        return logits.transpose(0, 1).contiguous()

    def _fused_loss(self, hidden: torch.Tensor) -> bool:
        """Whether the loss may bypass ``output_layer``'s ``forward``: the plain layer without
        bias or gathered output, no hooks on it that would miss the call, the hidden states in the
        weight's dtype and no autocast (which would pick the matmuls' dtype itself)."""
        layer = self.output_layer
        return (
            type(layer) is ColumnParallelLinear
            and hidden.dtype == layer.weight.dtype
            and not torch.is_autocast_enabled(hidden.device.type)
            and layer.bias is None
            and not layer.gather_output
            and not (
                layer._forward_pre_hooks
                or layer._forward_hooks
                or layer._backward_hooks
                or layer._backward_pre_hooks
            )
        )

    def _linear_cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses ``[b, s]`` from the final hidden states ``[s, b, h]`` without full-vocabulary
        logits (mcore-kernels' ``linear_cross_entropy``): the same values as ``output_layer`` and
        ``vocab_parallel_cross_entropy``; labels equal to -100 are ignored (loss 0)."""
        invalid = (labels != -100) & ((labels < 0) | (labels >= self.vocab_size))
        if invalid.any():
            bad = labels[invalid][0].item()
            raise ValueError(f"labels must be in [0, {self.vocab_size}) or -100, got {bad}")
        layer = self.output_layer
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, self.tp_group, tensor_parallel_output_grad=True
            )
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        s, b, _ = hidden.shape
        local = layer.weight.shape[0]
        start = dist.get_rank(self.tp_group) * local
        weight = layer.weight[: max(0, min(local, self.vocab_size - start))]  # no padded ids
        loss = linear_cross_entropy(
            hidden.reshape(s * b, -1),
            weight,
            labels.t().reshape(-1),
            group=self.tp_group,
            vocab_start=start,
            reduction="none",
        )
        return loss.view(s, b).t()

    def _exclude_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocab shard of the logits with the padded ids' columns set to ``-inf``."""
        if self.padded_vocab_size == self.vocab_size:
            return logits
        local = logits.shape[-1]
        real = self.vocab_size - dist.get_rank(self.tp_group) * local
        if real >= local:
            return logits
        padded = torch.arange(local, device=logits.device) >= real
        return logits.masked_fill(padded, float("-inf"))

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The full logits over exactly ``vocab_size`` ids from this rank's shard."""
        logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
        return logits[..., : self.vocab_size] if self.padded_vocab_size != self.vocab_size else logits

    def inference_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        inference_context: InferenceContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``InferenceModel.inference_forward``: logits ``[k, vocab]`` over the full vocabulary
        whatever ``parallel_output`` (last stage), else hidden states ``[t, 1, h]``.

        ``hidden_states`` is required exactly on a stage without ``pre_process``. Raises
        ``RuntimeError`` if the model or a submodule is in training mode (dropout would be on)."""
        if _any_in_training_mode(self):  # every step: a walk without ``modules()``' bookkeeping
            name = next(n for n, m in self.named_modules() if m.training) or "the model"
            raise RuntimeError(f"inference_forward needs eval mode, but {name} is in training mode")
        if (hidden_states is None) != self.pre_process:
            raise ValueError(
                f"hidden_states must be given exactly when pre_process is False (pre_process={self.pre_process})"
            )
        output = self._inference_forward(
            input_ids, position_ids, inference_context, hidden_states, gather=True
        )
        return output[0] if self.post_process else output

    def _inference_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        inference_context: InferenceContext,
        hidden_states: torch.Tensor | None,
        *,
        gather: bool,
    ) -> torch.Tensor:
        if self.config.sequence_parallel:
            raise ValueError("inference_context does not support sequence_parallel=True")
        hidden = self.embedding(input_ids, position_ids) if self.embedding is not None else hidden_states
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        hidden = self.decoder(hidden, rotary, inference_context=inference_context)
        if not self.post_process:
            return hidden
        if inference_context.logits_indices is not None:
            hidden = hidden[inference_context.logits_indices]
        logits = self._exclude_padding(self.output_layer(hidden)[0])  # [k, 1, padded v / tp]
        if gather:
            logits = self._gather_vocab(logits)
        return logits.transpose(0, 1)


def _any_in_training_mode(module: torch.nn.Module) -> bool:
    """Whether ``module`` or any module under it is in training mode."""
    pending = [module]
    while pending:
        current = pending.pop()
        if current.training:
            return True
        pending.extend(child for child in current._modules.values() if child is not None)
    return False
