"""The groups of one model replica and a step's forward across its pipeline stages."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_models import InferenceContext, InferenceModel
from mcore_parallel import P2PCommunicator, ProcessGroupCollection, get_group_device
from mcore_parallel.parallel_state import get_process_group_collection, model_parallel_is_initialized

from .errors import PipelineStageError, is_transient


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def model_groups(
    model: InferenceModel, pg_collection: ProcessGroupCollection | None = None
) -> ProcessGroupCollection | None:
    """The groups ``model`` was built with: ``pg_collection``, else the global ones of
    ``initialize_model_parallel`` if ``model`` uses their tensor-parallel group, else ``None``."""
    if pg_collection is not None:
        return pg_collection
    if model_parallel_is_initialized():
        groups = get_process_group_collection()
        if groups.tp is model.tp_group:
            return groups
    return None


def pipeline_group(model: InferenceModel, groups: ProcessGroupCollection | None) -> dist.ProcessGroup | None:
    """The pipeline group ``model`` is a stage of, or ``None`` when it is the whole model.

    Raises:
        ValueError: ``model`` lacks the embedding or the output layer but no pipeline group was
            found, or the stages do not form one model (see ``_stage_layout_error``).
    """
    pp = groups.pp if groups is not None else None
    first, last = model.pre_process, model.post_process
    if _size(pp) == 1:
        if not (first and last):
            raise ValueError(
                f"the model is a pipeline stage (pre_process={first}, post_process={last}) but no pipeline "
                "group of more than one rank was found: pass pg_collection, the groups it was built with"
            )
        return None
    error = _stage_layout_error(model, pp)
    if error is not None:
        raise ValueError(error)
    return pp


def _stage_layout_error(model: InferenceModel, pp: dist.ProcessGroup) -> str | None:
    """Why the stages of ``pp`` do not form one model, or ``None``; the same on every stage.

    Only the first stage may have ``pre_process``, only the last ``post_process``, and the
    stages' layers must follow each other from layer 1 (one model chunk per rank: virtual
    pipeline stages are not supported)."""
    layers = model.kv_cache_spec.layer_numbers
    mine = torch.tensor(
        [model.pre_process, model.post_process, layers.start, layers.stop],
        dtype=torch.long,
        device=get_group_device(pp),
    )
    stages = [torch.empty_like(mine) for _ in range(dist.get_world_size(pp))]
    dist.all_gather(stages, mine, group=pp)
    next_layer, last_stage = 1, len(stages) - 1
    for stage, (first, last, start, stop) in enumerate(t.tolist() for t in stages):
        if first != (stage == 0) or last != (stage == last_stage):
            return (
                f"stage {stage} of {last_stage + 1} has pre_process={bool(first)}, post_process={bool(last)}; "
                "only the first stage may embed and only the last may produce logits"
            )
        if start != next_layer:
            return (
                f"stage {stage} holds layers {start}..{stop - 1}, but the stages before it end at layer "
                f"{next_layer - 1}: one chunk per rank in stage order (virtual pipeline stages are not supported)"
            )
        next_layer = stop
    return None


def block_count_group(
    model: InferenceModel, groups: ProcessGroupCollection | None
) -> dist.ProcessGroup | None:
    """The ranks of this model replica, which must agree on the cache's block count: the
    model-parallel group (tensor x pipeline), or the one of the two that has several ranks."""
    tp, pp = model.tp_group, pipeline_group(model, groups)
    if _size(tp) > 1 and _size(pp) > 1:
        if groups.mp is None:
            raise ValueError("pg_collection.mp (tensor x pipeline) is needed to agree on the block count")
        return groups.mp
    return next((group for group in (tp, pp) if _size(group) > 1), None)


def agree_block_count(num_blocks: int, group: dist.ProcessGroup | None) -> int:
    """The smallest of every rank's ``num_blocks`` over ``group`` (``num_blocks`` without one)."""
    if group is None:
        return num_blocks
    count = torch.tensor([num_blocks], dtype=torch.long)
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())


class PipelineStage:
    """This rank's stage of a model split over ``group``; ``forward`` runs a step across the stages.

    Stage messages carry a status after their payload: 0 when every stage so far succeeded, else
    one plus the number of the stage whose forward raised, negated when its error was not
    transient (see ``is_transient``). A stage that receives a failure skips its forward and passes
    it on, so every rank learns of it, and of its kind, and none waits forever.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        ranks = dist.get_process_group_ranks(group)
        self.group = group
        self.stage, self.num_stages = ranks.index(dist.get_rank()), len(ranks)
        self.last_rank = ranks[-1]  # global rank of the last stage, which computes the logits
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self.comm_device = get_group_device(group)

    @classmethod
    def of(cls, model: InferenceModel, groups: ProcessGroupCollection | None) -> PipelineStage | None:
        """``model``'s stage (see ``pipeline_group``), or ``None`` without pipeline parallelism."""
        group = pipeline_group(model, groups)
        if group is None:
            return None
        spec = model.kv_cache_spec
        return cls(
            group,
            hidden_size=model.hidden_size,
            vocab_size=model.vocab_size,
            dtype=spec.dtype,
            device=spec.device,
        )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(
        self,
        model: InferenceModel,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        context: InferenceContext,
    ) -> torch.Tensor:
        """The logits ``[k, vocab]`` of the rows ``context.logits_indices``, on every stage.

        The first stage embeds ``input_ids``; each later one takes the previous stage's hidden
        states ``[t, 1, h]`` (``t`` tokens in this step, so no shape is exchanged) and sends its
        own on; the last stage broadcasts its logits to the others. If a stage's forward raised,
        every stage raises after the exchange: that stage its own error, the others one naming it
        of the same kind: a ``RuntimeError`` when that error was transient (so every stage retries
        the step), else a ``PipelineStageError`` (so every stage fails it).
        """
        tokens, rows = input_ids.shape[1], len(context.logits_indices)
        expected = (rows, self.vocab_size) if self.is_last else (tokens, 1, self.hidden_size)
        status, error, output, hidden_states = 0, None, None, None
        if not self.is_first:
            received = self._p2p(tokens).recv_forward()
            status = int(received[-1].item())
            hidden_states = received[:-1].view(tokens, 1, self.hidden_size).to(self.device)
        if status == 0:
            try:
                output = model.inference_forward(input_ids, position_ids, context, hidden_states)
                if tuple(output.shape) != expected:
                    raise ValueError(
                        f"stage {self.stage} output has shape {tuple(output.shape)}, not {expected}"
                    )
            except Exception as exc:  # reported to every stage below, with its kind
                status = self.stage + 1 if is_transient(exc) else -(self.stage + 1)
                error, output = exc, None
        if self.is_last:
            logits = self._message(output, rows * self.vocab_size, status)
        else:
            self._p2p(tokens).send_forward(self._message(output, tokens * self.hidden_size, status))
            logits = torch.empty(rows * self.vocab_size + 1, dtype=self.dtype, device=self.comm_device)
        dist.broadcast(logits, src=self.last_rank, group=self.group)
        status = int(logits[-1].item())
        if error is not None:
            raise error
        if status > 0:
            raise RuntimeError(f"pipeline stage {status - 1} failed this step's forward")
        if status < 0:
            raise PipelineStageError(
                f"pipeline stage {-status - 1} failed this step's forward with a non-transient error"
            )
        return logits[:-1].view(rows, self.vocab_size).to(self.device)

    def _p2p(self, tokens: int) -> P2PCommunicator:
        shape = (tokens * self.hidden_size + 1,)
        return P2PCommunicator(self.group, dtype=self.dtype, tensor_shape=shape, device=self.comm_device)

    def _message(self, payload: torch.Tensor | None, numel: int, status: int) -> torch.Tensor:
        """``payload`` flattened (zeros when ``None``), then ``status``."""
        message = torch.zeros(numel + 1, dtype=self.dtype, device=self.comm_device)
        if payload is not None:
            message[:-1] = payload.reshape(-1)
        message[-1] = status
        return message
