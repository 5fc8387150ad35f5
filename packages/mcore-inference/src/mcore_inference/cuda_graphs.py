"""Decode steps padded to a few static shapes, each captured once as a CUDA graph and replayed."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import torch
from mcore_api import internal_api
from mcore_models import InferenceModel

from .buckets import InferenceBatchDimensions, build_batch_buckets, match_bucket
from .context import DynamicInferenceContext
from .model_runner import DecodeBuffers, ModelRunner
from .scheduler import ScheduledChunk


@internal_api
class DecodeGraphRunner:
    """Runs decode-only steps (every chunk one token) of ``model`` padded to a static shape.

    A step of ``n`` requests is padded to the smallest decode-only bucket holding ``n`` (from
    ``buckets``; ``InferenceBatchDimensions(k, 0, k)``), and each request sees a key window of
    the next power of two blocks covering the longest sequence (capped at the blocks of
    ``context.max_sequence_length``), so attention costs follow the sequences, not the cache. With
    ``capture`` (a CUDA model) the forward of each shape is captured as a CUDA graph the first
    time it is needed, in one memory pool, and replayed after; without, the padded step runs
    eagerly (same arithmetic: how CPU tests check the padding). Steps with a prefill chunk, or
    more requests than the largest bucket, are not this runner's: ``run`` returns ``None``.
    Graphs read the KV cache's memory: call ``reset`` when the cache is freed.
    """

    def __init__(
        self,
        model: InferenceModel,
        context: DynamicInferenceContext,
        buckets: Sequence[InferenceBatchDimensions],
        *,
        capture: bool,
    ):
        self.buckets = sorted(b for b in buckets if b.prefill_req_count == 0)
        if not self.buckets:
            raise ValueError(f"no decode-only bucket (prefill_req_count == 0) among {list(buckets)}")
        if self.buckets[-1].decode_req_count > context.max_requests:
            raise ValueError(
                f"bucket {self.buckets[-1]} holds more requests than max_requests {context.max_requests}"
            )
        if capture and context.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, the cache is on {context.device}")
        self.model = model
        self.context = context
        self.capture = capture
        self.max_key_blocks = context.blocks_needed(context.max_sequence_length)
        self.runner = ModelRunner(model, context)
        self.buffers = DecodeBuffers(self.buckets[-1].decode_req_count, self.max_key_blocks, context.device)
        self.steps: Counter[tuple[int, int]] = Counter()  # padded (rows, key blocks) -> steps run
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[slice]] | None:
        """The logits ``[rows, vocab]`` of the padded step and each chunk's rows of them, or ``None``
        when the step is not decode-only or fits no bucket (run it eagerly)."""
        batch = InferenceBatchDimensions.of_step([chunk.length for chunk in chunks])
        bucket = match_bucket(batch, self.buckets) if batch.prefill_req_count == 0 else None
        if bucket is None:
            return None
        rows = bucket.decode_req_count
        needed = self.context.blocks_needed(max(chunk.end for chunk in chunks))
        key_blocks = min(1 << (needed - 1).bit_length(), self.max_key_blocks)
        logits_slices = self.runner.prepare_padded_decode(chunks, self.buffers, rows, key_blocks)
        shape = (rows, key_blocks)
        self.steps[shape] += 1
        if not self.capture:
            return self._forward(shape), logits_slices
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(shape)
        graph, logits = self._graphs[shape]
        graph.replay()
        return logits, logits_slices

    def _forward(self, shape: tuple[int, int]) -> torch.Tensor:
        view = self.buffers.view(*shape)
        self.runner.use_padded_decode(view)  # masks computed afresh in every (captured) forward
        with torch.inference_mode():
            return self.model.inference_forward(view.input_ids, view.position_ids, self.context)

    def _capture(self, shape: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The buffers hold this step's real layout: warm-up runs rewrite the same keys and values
        # into the same slots, so they change nothing the replay would not.
        side = torch.cuda.Stream(self.context.device)
        side.wait_stream(torch.cuda.current_stream(self.context.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(shape)
        torch.cuda.current_stream(self.context.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(shape)
        return graph, logits

    def reset(self) -> None:
        """Drop every captured graph (they read the freed cache); later steps capture anew."""
        self._graphs.clear()
        self._pool = None


def graph_runner_for(
    model: InferenceModel,
    context: DynamicInferenceContext,
    cuda_graphs: bool | Sequence[InferenceBatchDimensions],
    pipeline: object | None,
) -> DecodeGraphRunner | None:
    """The engine's runner for its ``cuda_graphs`` argument: ``None`` for ``False``; for ``True``
    the buckets of ``build_batch_buckets``; on a CPU model the padded steps run eagerly, with a
    warning. Pipeline stages (``pipeline`` not ``None``) and Mamba layers (a context with
    ``mamba_slots``) are refused."""
    if cuda_graphs is False:
        return None
    if pipeline is not None:
        raise NotImplementedError("cuda_graphs with pipeline stages is not supported; run the stages eagerly")
    if context.mamba_slots is not None:
        raise NotImplementedError("cuda_graphs with Mamba layers is not supported; run the model eagerly")
    if cuda_graphs is True:
        cuda_graphs = build_batch_buckets(min(context.max_requests, context.max_tokens), context.max_tokens)
    capture = context.device.type == "cuda"
    if not capture:
        warnings.warn(
            f"cuda_graphs needs a CUDA model; padded decode steps run eagerly on {context.device}",
            stacklevel=3,
        )
    return DecodeGraphRunner(model, context, cuda_graphs, capture=capture)
