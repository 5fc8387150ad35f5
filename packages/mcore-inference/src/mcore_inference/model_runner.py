"""Lays a step's ``ScheduledChunk``s out in the KV cache and runs the model over them: eagerly
(one flattened row of any shape) or padded to a static decode shape (what CUDA graphs replay)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from mcore_api import internal_api
from mcore_models import InferenceModel, MambaStepLayout

from .attention import DecodeBatch, PrefillChunk, StepAttention
from .context import DynamicInferenceContext
from .errors import RequestOverflowError, TokenOverflowError
from .host_tensor import host_tensor
from .pipeline import PipelineStage
from .scheduler import ScheduledChunk


@internal_api
class DecodeView(NamedTuple):
    """The tensors of one padded decode shape: ``rows`` requests seeing ``key_blocks`` blocks each."""

    input_ids: torch.Tensor  # [1, rows]
    position_ids: torch.Tensor  # [1, rows]
    positions: torch.Tensor  # [rows], the same memory as position_ids
    token_slots: torch.Tensor  # [rows]
    block_table: torch.Tensor  # [rows, key_blocks]
    logits_indices: torch.Tensor  # [rows]: 0 .. rows - 1


@internal_api
class DecodeBuffers:
    """Device tensors at fixed addresses that padded decode steps of up to ``max_rows`` requests
    and ``max_blocks`` key blocks read: a CUDA graph captured over a ``view`` replays on whatever
    a later step copies into the same view."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self._ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._token_slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._block_table = torch.zeros(max_rows * max_blocks, dtype=torch.long, device=device)
        self._rows = torch.arange(max_rows, device=device)

    def view(self, rows: int, key_blocks: int) -> DecodeView:
        if not (1 <= rows <= self.max_rows and 1 <= key_blocks <= self.max_blocks):
            raise ValueError(f"a view of {rows} x {key_blocks} exceeds {self.max_rows} x {self.max_blocks}")
        return DecodeView(
            self._ids[:rows].view(1, rows),
            self._positions[:rows].view(1, rows),
            self._positions[:rows],
            self._token_slots[:rows],
            self._block_table[: rows * key_blocks].view(rows, key_blocks),
            self._rows[:rows],
        )


def _token_slots(block_ids: Sequence[int], start: int, end: int, size: int) -> list[int]:
    """The cache slots of positions ``start .. end - 1`` in blocks ``block_ids`` of ``size``
    tokens: a range per block, no loop over tokens."""
    slots: list[int] = []
    for index in range(start // size, -(-end // size)):
        first = index * size
        base = block_ids[index] * size - first
        slots += range(base + max(start, first), base + min(end, first + size))
    return slots


def _token_layout(chunks: Sequence[ScheduledChunk], size: int) -> torch.Tensor:
    """``[3, t]`` (host): the token ids, positions and cache slots of every token of ``chunks``
    (blocks of ``size`` tokens), from one list each: one tensor built, one copy to the device."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for chunk in chunks:
        request, start = chunk.request, chunk.start
        if chunk.length == 1:  # a decode (most chunks): one token, in one block
            ids.append(request.tokens[start])
            positions.append(start)
            slots.append(request.block_ids[start // size] * size + start % size)
        else:
            end = start + chunk.length
            ids += request.tokens[start:end]
            positions += range(start, end)
            slots += _token_slots(request.block_ids, start, end, size)
    return host_tensor(itertools.chain(ids, positions, slots)).view(3, len(ids))


def _logits_slices(chunks: Sequence[ScheduledChunk], offsets: Sequence[int]) -> tuple[list[int], list[slice]]:
    """Rows of the step whose logits are needed, and each chunk's share of them."""
    rows: list[int] = []
    slices: list[slice] = []
    for chunk, offset in zip(chunks, offsets, strict=True):
        first = len(rows)
        if chunk.logits == "all":
            rows.extend(range(offset, offset + chunk.length))
        elif chunk.logits == "last":
            rows.append(offset + chunk.length - 1)
        slices.append(slice(first, len(rows)))
    return rows, slices


@internal_api
class ModelRunner:
    """Runs steps of ``model`` over ``context``'s cache (through ``pipeline``'s stages if given).

    ``prepare_step`` lays chunks out as one flattened row: token ids and positions, the cache slot
    of every new token (from its request's blocks, without a loop over tokens), the rows
    whose logits the step needs, and ``StepAttention`` (decode rows batched, each prefill chunk on
    its own; see ``attention``). ``prepare_padded_decode`` does the same for one-token chunks in a
    static shape. ``layout_seconds`` and ``forward_seconds`` add up the host time spent laying
    steps out and in the model's forward (``run``)."""

    def __init__(
        self, model: InferenceModel, context: DynamicInferenceContext, pipeline: PipelineStage | None = None
    ):
        self.model, self.context, self.pipeline = model, context, pipeline
        self.layout_seconds = 0.0
        self.forward_seconds = 0.0

    def run(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[slice]]:
        """Lay out and run one eager step: the logits ``[k, vocab]`` and each chunk's rows of them."""
        start = time.perf_counter()
        input_ids, position_ids, logits_slices = self.prepare_step(chunks)
        laid_out = time.perf_counter()
        with torch.inference_mode():
            logits = self.forward(input_ids, position_ids)
        self.layout_seconds += laid_out - start
        self.forward_seconds += time.perf_counter() - laid_out
        return logits, logits_slices

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The logits ``[k, vocab]`` of the step laid out (rows ``context.logits_indices``), on every rank."""
        if self.pipeline is not None:
            return self.pipeline.forward(self.model, input_ids, position_ids, self.context)
        return self.model.inference_forward(input_ids, position_ids, self.context)

    def prepare_step(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
        """Lay ``chunks`` out as one row; return ``input_ids``, ``position_ids`` (``[1, t]``) and,
        per chunk, its rows of the step's logits. Each chunk's request must own blocks for its
        ``end`` tokens. Raises ``RequestOverflowError`` / ``TokenOverflowError`` over the limits."""
        context = self.context
        if len(chunks) > context.max_requests:
            raise RequestOverflowError(
                f"{len(chunks)} requests in one step, max_requests is {context.max_requests}"
            )
        lengths = [chunk.length for chunk in chunks]
        total = sum(lengths)
        if total > context.max_tokens:
            raise TokenOverflowError(f"{total} tokens in one step, max_tokens is {context.max_tokens}")
        tables = context.block_tables
        rows = [tables.sync(chunk.request.request_id, chunk.request.block_ids) for chunk in chunks]
        offsets = list(itertools.accumulate(lengths, initial=0))[:-1]
        ids, positions, slots = _token_layout(chunks, context.block_size).to(context.device).unbind(0)
        logits_rows, logits_slices = _logits_slices(chunks, offsets)
        context.step_attention = self._step_attention(chunks, rows, offsets, positions)
        if context.mamba_slots is not None:
            context.mamba_layout = self._mamba_layout(chunks, offsets)
        context.token_slots = slots
        context.logits_indices = host_tensor(logits_rows).to(context.device)
        return ids.view(1, total), positions.view(1, total), logits_slices

    def _step_attention(
        self,
        chunks: Sequence[ScheduledChunk],
        rows: Sequence[int],
        offsets: Sequence[int],
        positions: torch.Tensor,
    ) -> StepAttention:
        """The one-token chunks as one ``DecodeBatch`` (their ``positions``, block-table ``rows``),
        each longer one as a ``PrefillChunk``."""
        context = self.context
        device, size, table = context.device, context.block_size, context.block_tables.table
        step = StepAttention()
        decode_rows = [i for i, chunk in enumerate(chunks) if chunk.length == 1]
        if decode_rows:
            decode_positions = [chunks[i].start for i in decode_rows]
            width = context.blocks_needed(max(decode_positions) + 1)
            offsets_of_decodes = [offsets[i] for i in decode_rows]
            first, last = offsets_of_decodes[0], offsets_of_decodes[-1]
            contiguous = last - first == len(decode_rows) - 1  # offsets only grow
            step_rows = slice(first, last + 1) if contiguous else host_tensor(offsets_of_decodes).to(device)
            step.decode = DecodeBatch(
                step_rows,
                positions[step_rows],
                table[host_tensor([rows[i] for i in decode_rows]), :width].to(device),
                size,
                host_positions=decode_positions,
            )
        for chunk, row, offset in zip(chunks, rows, offsets, strict=True):
            if chunk.length > 1:
                blocks = table[row, : context.blocks_needed(chunk.end)].to(device)
                step.prefills.append(
                    PrefillChunk(slice(offset, offset + chunk.length), chunk.start, chunk.end, blocks, size)
                )
        return step

    def _mamba_layout(self, chunks: Sequence[ScheduledChunk], offsets: Sequence[int]) -> MambaStepLayout:
        """Each chunk's Mamba state slot (zeroed for a chunk from the first token): one-token
        chunks batched as decode rows, longer ones as prefill segments."""
        slots = [
            self.context.mamba_slots.take(chunk.request.request_id, fresh=chunk.start == 0)
            for chunk in chunks
        ]
        decodes = [i for i, chunk in enumerate(chunks) if chunk.length == 1]
        device = self.context.device
        return MambaStepLayout(
            host_tensor([offsets[i] for i in decodes]).to(device),
            host_tensor([slots[i] for i in decodes]).to(device),
            tuple(
                (slice(offset, offset + chunk.length), slot)
                for chunk, offset, slot in zip(chunks, offsets, slots, strict=True)
                if chunk.length > 1
            ),
        )

    def prepare_padded_decode(
        self, chunks: Sequence[ScheduledChunk], buffers: DecodeBuffers, rows: int, key_blocks: int
    ) -> list[slice]:
        """Lay out one-token ``chunks`` padded to ``rows`` requests seeing ``key_blocks`` blocks each,
        in ``buffers``' views of that shape (which a captured CUDA graph reads); return, per chunk,
        its rows of the step's logits (``logits_indices`` is every row). Padded rows are token 0 at
        position 0, writing only ``padding_slot`` and reading block 0 (their output is unused)."""
        context = self.context
        if any(chunk.length != 1 for chunk in chunks) or len(chunks) > rows:
            raise ValueError(f"a padded decode step takes at most {rows} one-token chunks")
        if max(chunk.end for chunk in chunks) > key_blocks * context.block_size:
            raise ValueError(f"a chunk in this step sees more than {key_blocks} blocks")
        size, count = context.block_size, len(chunks)
        tables = context.block_tables
        table_rows = host_tensor([tables.sync(c.request.request_id, c.request.block_ids) for c in chunks])
        block_table = torch.zeros(rows, key_blocks, dtype=torch.long)
        block_table[:count] = tables.table[table_rows, :key_blocks]
        positions = torch.zeros(rows, dtype=torch.long)
        positions[:count] = host_tensor([chunk.start for chunk in chunks])
        token_slots = torch.full((rows,), context.padding_slot, dtype=torch.long)
        token_slots[:count] = (
            block_table[:count].gather(1, (positions[:count] // size).view(-1, 1)).view(-1) * size
        )
        token_slots[:count] += positions[:count] % size
        ids = torch.zeros(rows, dtype=torch.long)
        ids[:count] = host_tensor([chunk.request.tokens[chunk.start] for chunk in chunks])
        view = buffers.view(rows, key_blocks)
        view.input_ids.copy_(ids.view(1, rows))
        view.positions.copy_(positions)  # position_ids share this memory
        view.block_table.copy_(block_table)
        view.token_slots.copy_(token_slots)
        self.use_padded_decode(view)
        return [slice(i, i + 1) if chunk.logits != "none" else slice(i, i) for i, chunk in enumerate(chunks)]

    def use_padded_decode(self, view: DecodeView) -> None:
        """Point the context at ``view``'s step, with fresh attention masks: call before every
        forward over a view (a CUDA graph captures the masks' computation from its positions)."""
        context = self.context
        context.token_slots = view.token_slots
        context.logits_indices = view.logits_indices
        decode = DecodeBatch(
            slice(0, len(view.positions)), view.positions, view.block_table, context.block_size
        )
        context.step_attention = StepAttention(decode=decode)
